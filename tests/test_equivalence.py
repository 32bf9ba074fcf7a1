"""Every strategy and backend equals the single-process reference, through the path
users take (`pool.train` on real engines), for both built-in models over 20 steps.

Global batch 16 everywhere: single 16 x 1, data parallel 2 ranks x 4 x accumulation 2,
tensor parallel and pipelines 8 x 2 (their one replica sees the whole batch).
"""

from __future__ import annotations

import pytest
import torch

import nbpar

pytestmark = pytest.mark.timeout(900)

STEPS, SEED = 20, 7
DATA_PARALLEL = [(s, b) for b in ("torch", "deepspeed") for s in ("ddp", "zero1", "zero2", "zero3")]
GPT_ONLY = [("tp", "torch"), ("pipeline", "torch"), ("pipeline", "deepspeed")]


def _losses(pool, **kw) -> list[float]:
    cfg = nbpar.TrainConfig(steps=STEPS, seed=SEED, **kw)
    return pool.train(cfg).result()["losses"]


@pytest.mark.parametrize("model", ["tiny_gpt", "simple_cnn"])
def test_every_strategy_and_backend_equals_single(pool, model):
    ref = torch.tensor(_losses(pool, model=model, strategy="single", micro_batch=16))
    assert ref[-1] < ref[0], "the reference does not learn: a useless comparison"
    cases = DATA_PARALLEL + (GPT_ONLY if model == "tiny_gpt" else [])
    for strategy, backend in cases:
        whole_batch = strategy in ("tp", "pipeline")
        got = _losses(
            pool,
            model=model,
            strategy=strategy,
            backend=backend,
            micro_batch=8 if whole_batch else 4,
            grad_accum=2,
        )
        torch.testing.assert_close(
            torch.tensor(got),
            ref,
            atol=1e-5,
            rtol=0,
            msg=lambda m: f"{strategy}/{backend} on {model}: {m}",
        )


def test_clipping_and_schedule_apply_on_every_backend(pool):
    """The update rule (clip the global norm, warm up then decay the lr) changes the
    curve, and changes it the same way in the reference, torch ZeRO-3, tensor
    parallel, a pipeline and DeepSpeed."""
    rule = dict(
        grad_clip=0.05,
        lr=3e-3,
        lr_schedule={
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": STEPS,
                "warmup_num_steps": 4,
                "warmup_max_lr": 3e-3,
                "warmup_type": "linear",
            },
        },
    )
    plain = torch.tensor(_losses(pool, strategy="single", micro_batch=16, lr=3e-3))
    ref = torch.tensor(_losses(pool, strategy="single", micro_batch=16, **rule))
    assert (ref - plain).abs().max() > 1e-3, "clipping and schedule changed nothing"
    for strategy, backend in [
        ("zero3", "torch"),
        ("zero2", "deepspeed"),
        ("tp", "torch"),
        ("pipeline", "torch"),
    ]:
        dp = strategy.startswith("zero")
        got = _losses(
            pool,
            strategy=strategy,
            backend=backend,
            micro_batch=4 if dp else 8,
            grad_accum=2,
            **rule,
        )
        torch.testing.assert_close(
            torch.tensor(got), ref, atol=1e-5, rtol=0, msg=lambda m: f"{strategy}/{backend}: {m}"
        )
