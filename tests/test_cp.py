"""Context parallelism (strategy cp, and cp inside hybrid) on real gloo processes: every
run of 20 fp32 steps equals the single-process reference on the same global batch within
1e-5, on tiny_gpt and hf:llama (2 key/value heads for 4 query heads); a metered step sends
the bytes the ring and Ulysses algorithms say, and a rank's activations fall with cp.

Each rank holds micro_batch 4 sequences of seq_len / cp tokens; dp replicas read
different sequences, so the reference's global batch is 4 x dp. Half the runs use SGD,
where a gradient averaged over the wrong number of ranks changes the curve (Adam would
hide a uniform scale).
"""

from __future__ import annotations

import functools

import pytest
import torch

from nbpar.config import GPTConfig, TrainConfig
from tests.distributed import run_distributed
from tests.reference.hf import SMALL

pytestmark = pytest.mark.timeout(600)

STEPS, MICRO, WORLD = 20, 4, 4
GPT = GPTConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16)
MODELS = {"tiny_gpt": {"model": "tiny_gpt"}, "llama": {"model": "hf:llama"}}
MODELS["llama"]["model_config"] = SMALL["hf:llama"]  # 4 heads, 2 key/value heads
SGD = {"optimizer": "sgd", "lr": 0.03}  # larger steps on these tiny models are chaotic

#: name -> (model, TrainConfig fields); strategy cp alone: cp = 4, or cp = 2 x dp = 2
ALONE = {
    "ring cp4 tiny_gpt": ("tiny_gpt", dict(strategy="cp", attention="ring", **SGD)),
    "ulysses cp4 tiny_gpt": ("tiny_gpt", dict(strategy="cp", attention="ulysses")),
    "ring dp2 x cp2 tiny_gpt": ("tiny_gpt", dict(strategy="cp", cp=2, attention="ring")),
    "ulysses dp2 x cp2 tiny_gpt": (
        "tiny_gpt",
        dict(strategy="cp", cp=2, attention="ulysses", **SGD),
    ),
    "ring cp4 llama": ("llama", dict(strategy="cp", attention="ring")),
    "ulysses cp4 llama": ("llama", dict(strategy="cp", attention="ulysses", **SGD)),
    "ring dp2 x cp2 llama": ("llama", dict(strategy="cp", cp=2, attention="ring", **SGD)),
    "ulysses dp2 x cp2 llama": ("llama", dict(strategy="cp", cp=2, attention="ulysses")),
}
#: cp with FSDP2 over dp x cp, with tensor parallelism, with pipeline stages
COMBINED = {
    "ring dp2 x cp2 FSDP (ZeRO-3) tiny_gpt": (
        "tiny_gpt",
        dict(strategy="cp", cp=2, attention="ring", fsdp_reshard=True, **SGD),
    ),
    "ring cp2 x tp2 tiny_gpt": ("tiny_gpt", dict(strategy="hybrid", cp=2, tp=2, **SGD)),
    "ulysses cp2 x tp2 FSDP (ZeRO-2) llama": (
        "llama",
        dict(strategy="hybrid", cp=2, tp=2, attention="ulysses", fsdp_reshard=False),
    ),
    "ulysses pp2 x cp2 tiny_gpt": (
        "tiny_gpt",
        dict(strategy="hybrid", pp=2, cp=2, attention="ulysses", grad_accum=2, **SGD),
    ),
    "ring pp2 x cp2 FSDP (ZeRO-3) llama": (
        "llama",
        dict(strategy="hybrid", pp=2, cp=2, grad_accum=2, fsdp_reshard=True, **SGD),
    ),
}


def config(model: str, fields: dict) -> TrainConfig:
    base = dict(gpt=GPT, steps=STEPS, seed=0, micro_batch=MICRO, **MODELS[model])
    return TrainConfig(**{**base, **fields})


def _train(rank, world, runs):
    """Each run in turn on this rank: (losses, bytes by op, activation bytes)."""
    from nbpar.train.loop import run_training

    out = {}
    for name, (model, fields) in runs.items():
        res = run_training(config(model, fields))
        out[name] = (res["losses"], res["comm_bytes_by_op"], res["activation_bytes"])
    return out


def reference(model: str, fields: dict) -> dict:
    """The single-process run of the same global batch: its losses and activations."""
    keep = tuple((k, v) for k, v in fields.items() if k in ("optimizer", "lr", "grad_accum"))
    return _single(model, keep, MICRO * config(model, fields).dims(WORLD).dp)


@functools.cache
def _single(model: str, keep: tuple, micro_batch: int) -> dict:
    from nbpar.train.loop import run_training

    res = run_training(
        config(model, dict(strategy="single", micro_batch=micro_batch, **dict(keep)))
    )
    return {"losses": res["losses"], "activation_bytes": res["activation_bytes"]}


def check_against_single(results: list[dict], runs: dict) -> None:
    for name, (model, fields) in runs.items():
        ref = torch.tensor(reference(model, fields)["losses"])
        assert ref[-3:].mean() < ref[:3].mean() - 0.05, f"{name}: the reference does not learn"
        for rank, per_rank in enumerate(results):
            got = torch.tensor(per_rank[name][0])
            torch.testing.assert_close(
                got, ref, atol=1e-5, rtol=0, msg=lambda m: f"{name}, rank {rank}: {m}"
            )


@pytest.fixture(scope="module")
def alone():
    """Strategy cp's runs on 4 gloo processes, each rank's results."""
    return run_distributed(_train, WORLD, ALONE, timeout=540)


def test_context_parallel_equals_single(alone):
    check_against_single(alone, ALONE)


def test_context_parallel_with_fsdp_tensor_and_pipeline_parallel_equals_single():
    results = run_distributed(_train, WORLD, COMBINED, timeout=540)
    check_against_single(results, COMBINED)


def expected_bytes(model: str, fields: dict) -> dict[str, float]:
    """What one rank sends in a step, from the sizes: per attention layer and micro-batch,
    the ring sends cp - 1 K/V block pairs forward, and backward the pairs again plus cp
    pairs of their gradients (the last hop brings them home); Ulysses moves (cp-1)/cp of
    q, k, v and the output forward and of their gradients backward (key/value heads that
    do not divide by cp travel repeated to the query heads); the gradients are
    all-reduced over the dp x cp ranks once a step (2 (n-1)/n of them, ring all-reduce)."""
    from nbpar.model.models import build_model

    cfg = config(model, fields)
    dims = cfg.dims(WORLD)
    cp, n = dims.cp, dims.dp * dims.cp
    if model == "tiny_gpt":
        layers, width, heads, kv = GPT.n_layers, GPT.d_model, GPT.n_heads, GPT.n_heads
    else:
        c = SMALL["hf:llama"]
        layers, width = c["num_hidden_layers"], c["hidden_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    tokens = MICRO * GPT.seq_len // cp  # one rank's tokens of a micro-batch
    q_block = tokens * width * 4  # fp32 bytes of one rank's q (or output), every head
    kv_block = q_block * kv // heads
    per_layer = cfg.grad_accum * layers
    params = sum(p.numel() for p in build_model(cfg).parameters())
    out = {"all_reduce": 2 * (n - 1) / n * params * 4}
    if cfg.attention == "ring":
        out["send_recv"] = per_layer * 2 * kv_block * ((cp - 1) + (cp - 1) + cp)
    else:
        moved = kv_block if kv % cp == 0 else q_block
        out["all_to_all"] = per_layer * 2 * (2 * q_block + 2 * moved) * (cp - 1) / cp
    return out


def test_bytes_per_step_by_op_match_the_algorithms(alone):
    for name, (model, fields) in ALONE.items():
        want = expected_bytes(model, fields)
        for rank, per_rank in enumerate(alone):
            got = per_rank[name][1]
            assert set(got) == set(want), (name, rank, got)
            for op, value in want.items():
                assert got[op] == pytest.approx(value, rel=0.1), (name, rank, op, got, want)


def test_activations_per_rank_fall_with_cp(alone):
    """A rank saves for backward what its s/cp tokens need: about 1/cp of one process's
    activations at the same micro-batch (Ulysses keeps one more (b, s/cp, d) tensor a
    layer: the attention's output both head-split, for its backward, and sequence-split,
    for the output projection's)."""
    for model in MODELS:
        whole = reference(model, dict(strategy="cp", cp=4))["activation_bytes"]
        for name, (m, fields) in ALONE.items():
            if m != model:
                continue
            cp = config(m, fields).dims(WORLD).cp
            for rank, per_rank in enumerate(alone):
                assert per_rank[name][2] > 0, (name, rank)
                share = per_rank[name][2] / whole
                assert share < 1 / cp + 0.05, (name, rank, share)


#: DeepSpeed-Ulysses runs, each against the torch backend's run of the same name
DEEPSPEED = {
    "ulysses cp4 llama": dict(backend="deepspeed"),  # 2 key/value heads repeated to 4
    "ulysses dp2 x cp2 tiny_gpt": dict(deepspeed_config={"zero_optimization": {"stage": 2}}),
}


def test_deepspeed_ulysses_equals_the_torch_backend(alone):
    """DeepSpeed's DistributedAttention around each layer's attention, ZeRO 0 and 2 over
    dp x cp, trains as the torch backend's Ulysses does (and as one process)."""
    runs = {
        name: (ALONE[name][0], {**ALONE[name][1], **extra}) for name, extra in DEEPSPEED.items()
    }
    results = run_distributed(_train, WORLD, runs, timeout=540)
    check_against_single(results, runs)
    for name in runs:
        for rank, (ds, torch_run) in enumerate(zip(results, alone)):
            torch.testing.assert_close(
                torch.tensor(ds[name][0]),
                torch.tensor(torch_run[name][0]),
                atol=1e-5,
                rtol=0,
                msg=lambda m: f"{name}, rank {rank}: {m}",
            )
            # DeepSpeed's all-to-alls move what nbpar's do (its ZeRO, other collectives)
            assert ds[name][1]["all_to_all"] == torch_run[name][1]["all_to_all"], name
