"""Hugging Face GPT-2 and Llama (random init from a small config, byte-level data):
activation checkpointing, the families' own tensor-parallel plans, and the named
mesh. That every strategy and backend equals the single-process reference is
tests/test_equivalence.py's table, these models included."""

from __future__ import annotations

import pytest
import torch

import nbpar
from nbpar.model.models import build_model
from tests.reference.hf import SMALL

pytestmark = pytest.mark.timeout(900)

STEPS, SEED = 20, 5


def _run(pool, model, **kw):
    cfg = nbpar.TrainConfig(
        model=model, model_config=SMALL[model], steps=STEPS, seed=SEED, lr=3e-3, **kw
    )
    return pool.train(cfg).result()


def test_activation_checkpointing_same_losses_less_activation_memory(pool):
    kw = dict(strategy="zero3", micro_batch=8, grad_accum=1)
    plain = _run(pool, "hf:llama", **kw)
    ckpt = _run(pool, "hf:llama", activation_checkpointing=True, **kw)
    torch.testing.assert_close(
        torch.tensor(ckpt["losses"]), torch.tensor(plain["losses"]), atol=1e-5, rtol=0
    )
    for a, b in zip(ckpt["ranks"], plain["ranks"]):
        assert a["activation_bytes"] < 0.8 * b["activation_bytes"], (a, b)


def test_llama_splits_by_its_own_tp_plan():
    """The tensor-parallel plan is transformers' base_model_tp_plan of the family."""
    cfg = nbpar.TrainConfig(model="hf:llama", model_config=SMALL["hf:llama"])
    plan = build_model(cfg).parallel_plan()
    assert {k: type(v).__name__ for k, v in plan.tp.items()} == {
        "self_attn.q_proj": "ColwiseParallel",
        "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel",
        "self_attn.o_proj": "RowwiseParallel",
        "mlp.gate_proj": "ColwiseParallel",
        "mlp.up_proj": "ColwiseParallel",
        "mlp.down_proj": "RowwiseParallel",
    }
    assert plan.tp_widths["number of key/value heads"] == 2


def test_gpt2_splits_by_heads_in_linear_form():
    """GPT-2's fused c_attn becomes three Linear layers (same function, checked against
    transformers below), split column-wise; the attention learns its local width."""
    cfg = nbpar.TrainConfig(model="hf:gpt2", model_config=SMALL["hf:gpt2"])
    plan = build_model(cfg).parallel_plan()
    assert {k: type(v).__name__ for k, v in plan.tp.items()} == {
        "attn.c_attn.q": "ColwiseParallel",
        "attn.c_attn.k": "ColwiseParallel",
        "attn.c_attn.v": "ColwiseParallel",
        "attn.c_proj": "RowwiseParallel",
        "attn": "LocalHeads",
        "mlp.c_fc": "ColwiseParallel",
        "mlp.c_proj": "RowwiseParallel",
    }
    assert plan.tp_widths == {"number of attention heads": 4, "MLP width": 128}
    attn = plan.layers["0"].attn

    class Mesh:
        def size(self):
            return 2

    plan.tp["attn"]._apply(attn, Mesh())
    assert attn.split_size == 16  # each of q, k, v is 32 / 2 wide on a rank


def test_forward_equals_transformers_own():
    """nbpar runs the family's parts itself; the logits are those of *ForCausalLM."""
    import transformers

    from nbpar.model.hf import hf_config

    for model, cls in (
        ("hf:llama", transformers.LlamaForCausalLM),
        ("hf:gpt2", transformers.GPT2LMHeadModel),
    ):
        cfg = nbpar.TrainConfig(model=model, model_config=SMALL[model], seed=2)
        ours = build_model(cfg)
        with torch.random.fork_rng():
            torch.manual_seed(2)
            theirs = cls(hf_config(model, SMALL[model]))
        x = torch.randint(0, 256, (2, 16))
        torch.testing.assert_close(ours(x), theirs(input_ids=x).logits)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(model="hf:gpt2", strategy="tp", model_config={"n_embd": 48, "n_head": 3}),
            r"tp=2 must divide the attention heads of hf:gpt2 \(3\)",
        ),
        (
            dict(
                model="hf:llama",
                strategy="tp",
                model_config={**SMALL["hf:llama"], "num_key_value_heads": 1},
            ),
            r"tp=2 must divide the key/value heads of hf:llama \(1\)",
        ),
        (
            dict(
                model="hf:llama",
                strategy="pipeline",
                model_config={**SMALL["hf:llama"], "num_hidden_layers": 1},
            ),
            "pp=2 pipeline stages need at least 2 layers",
        ),
        (
            dict(
                model="hf:llama",
                strategy="pipeline",
                grad_accum=2,
                model_config={**SMALL["hf:llama"], "tie_word_embeddings": True},
            ),
            "tied to the head",
        ),
        (dict(model="hf:llama", model_config={"hidden_sise": 64}), "hidden_sise"),
        (dict(model="hf:mistral"), "not a known Hugging Face family"),
        (
            dict(
                model="hf:llama",
                strategy="pipeline",
                backend="deepspeed",
                grad_accum=2,
                model_config={**SMALL["hf:llama"], "tie_word_embeddings": True},
            ),
            "tied to the head",
        ),
    ],
)
def test_bad_hf_input_is_one_line(change, message):
    from nbpar.probe import check_model

    with pytest.raises(ValueError, match=message) as err:
        cfg = nbpar.TrainConfig(**change).validate(2)
        check_model(cfg, 2)
    assert "\n" not in str(err.value)


def test_estimate_memory_counts_a_models_parameters():
    cfg = nbpar.TrainConfig(model="hf:llama", model_config=SMALL["hf:llama"])
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    by_model = nbpar.estimate_memory(model, 2, "zero3").per_rank_bytes
    assert by_model == nbpar.estimate_memory(n, 2, "zero3").per_rank_bytes
    assert by_model["params"] == 4 * n / 2
    with pytest.raises(ValueError, match="or a model"):
        nbpar.estimate_memory("llama", 2, "zero3")


def test_llama_on_the_named_mesh_equals_single(pool):
    """Hybrid (pp=2 of the ("pp", "dp", "tp") mesh) and ZeRO-3 over tensor-parallel
    shards (tp=2) take the same plan; on 2 engines each equals the reference."""
    ref = torch.tensor(_run(pool, "hf:llama", strategy="single", micro_batch=16)["losses"])
    for kw in (
        dict(strategy="hybrid", dp=1, tp=1, pp=2, schedule="gpipe"),
        dict(strategy="zero3", tp=2),
    ):
        got = _run(pool, "hf:llama", micro_batch=8, grad_accum=2, **kw)["losses"]
        torch.testing.assert_close(
            torch.tensor(got), ref, atol=1e-5, rtol=0, msg=lambda m: f"{kw}: {m}"
        )
