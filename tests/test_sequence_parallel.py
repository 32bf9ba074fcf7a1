"""Sequence parallelism (Korthikanti et al. 2022) and the output layer split by columns,
on real gloo processes: losses equal to one process within 1e-5 over 20 steps (tp 2, and
inside hybrid with dp and pp), the bytes the theory says, less activation memory than
tensor parallelism without it, and 1/tp of the head on each rank."""

from __future__ import annotations

import pytest
import torch

from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.config import GPTConfig, TrainConfig
from nbpar.errors import ConfigError
from nbpar.train.loop import run_training
from tests.distributed import run_distributed
from tests.reference.hf import SMALL

GPT = GPTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=4)
BASE = dict(micro_batch=2, grad_accum=2, steps=20, gpt=GPT)
LLAMA = {**SMALL["hf:llama"], "num_hidden_layers": 4}
MODELS = {"tiny_gpt": {}, "hf:llama": {"model": "hf:llama", "model_config": LLAMA}}
KEYS = ("losses", "comm_bytes_by_op", "activation_bytes", "param_bytes")


def _single(model: str, dp: int = 1) -> list[float]:
    cfg = TrainConfig(strategy="single", **{**BASE, "micro_batch": 2 * dp}, **MODELS[model])
    return run_training(cfg)["losses"]


def _train(rank, world, runs):
    """Each run's losses, bytes by op, activation and parameter bytes on this rank."""
    out = []
    for model, kw in runs:
        res = run_training(TrainConfig(**{**BASE, **MODELS[model], **kw}))
        out.append({k: res[k] for k in KEYS})
    return out


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


@pytest.mark.timeout(420)
def test_tp2_sequence_parallel_matches_single_sends_the_theory_and_keeps_less():
    # without sequence parallelism (tests/test_tensor.py checks its losses) 3 steps: the
    # metered one is the third
    runs = [
        (model, dict(strategy="tp", sequence_parallel=sp, **({} if sp else {"steps": 3})))
        for model in MODELS
        for sp in (False, True)
    ]
    results = run_distributed(_train, 2, runs, timeout=400)
    for i, (model, kw) in enumerate(runs):
        want = _single(model)
        for rank_runs in results:
            _close(rank_runs[i]["losses"], want[: len(rank_runs[i]["losses"])])
        assert len(results[0][i]["losses"]) == (20 if kw["sequence_parallel"] else 3)
    # one metered step of 2 micro-batches of (2, 16, 32) fp32 hidden states, vocab 256
    hidden, logits = 2 * 16 * 32 * 4, 2 * 16 * 256 * 4
    for i, (model, kw) in enumerate(runs):
        got = results[0][i]["comm_bytes_by_op"]
        theory = comm_bytes_per_step(
            "tp",
            param_bytes=0,
            tp=2,
            grad_accum=2,
            layers=4,
            activation_bytes=hidden,
            logits_bytes=logits,
            sequence_parallel=kw["sequence_parallel"],
            column_linears=5 if model == "hf:llama" else 4,  # + Llama's gate and up
        )
        assert sum(got.values()) == pytest.approx(theory, rel=0.10), (model, kw)
        ops = {"all_gather", "reduce_scatter" if kw["sequence_parallel"] else "all_reduce"}
        assert set(got) == ops, (model, kw)
    for i in (0, 2):  # without, then with sequence parallelism, per model
        plain, split = results[0][i], results[0][i + 1]
        assert split["activation_bytes"] < plain["activation_bytes"], runs[i][0]
        assert split["param_bytes"] == plain["param_bytes"]  # the norms stay whole


def _heads(rank, world):
    """Per model: the head's local shape, its vocabulary, the parameters the plan says
    tp leaves whole and those it left whole, on this rank."""
    from nbpar.dims import ParallelDims
    from nbpar.model.models import build_model
    from nbpar.model.plan import tp_replicated_parameters
    from nbpar.parallel.tensor import apply_tp

    tp = ParallelDims(tp=world, world_size=world).build_mesh("cpu")["tp"]
    out = {}
    for name, kw in MODELS.items():
        model = build_model(TrainConfig(strategy="tp", **BASE, **kw))
        replicated, vocab = tp_replicated_parameters(model), model.head.weight.shape[0]
        apply_tp(model, tp)
        whole = sum(p.numel() for p in model.parameters() if _whole(p))
        out[name] = tuple(model.head.weight.to_local().shape), vocab, replicated, whole
    return out


def _whole(p) -> bool:
    """Whether every tp rank holds all of ``p`` (a plain or a replicated tensor)."""
    return all(pl.is_replicate() for pl in getattr(p, "placements", ()))


@pytest.mark.timeout(300)
def test_the_output_layer_is_split_by_columns():
    heads, _ = run_distributed(_heads, 2)
    for local, vocab, replicated, whole in heads.values():
        assert local == (vocab // 2, 32)
        assert replicated == whole  # the plan's count: embeddings and norms only


@pytest.mark.timeout(420)
def test_hybrid_dp2_pp2_tp2_sequence_parallel_matches_single():
    """The 3-D layout, each stage's blocks sequence-parallel: a stage sends its s/tp tokens
    to the next; data parallel by one gradient all-reduce and by FSDP2 (ZeRO-2)."""
    runs = [
        ("tiny_gpt", dict(strategy="hybrid", dp=2, tp=2, pp=2, sequence_parallel=True, **dp))
        for dp in ({}, {"fsdp_reshard": False})
    ]
    results = run_distributed(_train, 8, runs, timeout=400)
    want = _single("tiny_gpt", dp=2)
    for i in range(len(runs)):
        for rank_runs in results:
            _close(rank_runs[i]["losses"], want)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(strategy="ddp"), "needs tp > 1"),
        (dict(strategy="hybrid", dp=2, pp=2), "needs tp > 1"),
        (dict(strategy="tp", model="hf:gpt2"), "sequence_parallel runs tiny_gpt and hf:llama"),
        (dict(strategy="tp", gpt=GPTConfig(seq_len=15)), "seq_len=15 does not divide by 2"),
        (dict(strategy="tp", sequence_parallel=1), "must be True or False"),
    ],
)
def test_sequence_parallel_is_refused_in_one_line(kw, words):
    kw = {"sequence_parallel": True, **kw}
    with pytest.raises(ConfigError, match=words) as err:
        TrainConfig(**kw).validate(world_size=4 if kw["strategy"] == "hybrid" else 2)
    assert "sequence_parallel" in err.value.fields


def test_sequence_parallel_waits_for_the_engines_when_tp_takes_them():
    TrainConfig(strategy="tp", sequence_parallel=True).validate()  # tp = the engines
    TrainConfig(strategy="tp", sequence_parallel=True).validate(world_size=2)
    with pytest.raises(ConfigError, match="needs tp > 1"):
        TrainConfig(strategy="tp", sequence_parallel=True).validate(world_size=1)
