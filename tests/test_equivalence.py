"""Every strategy and backend a model's structure allows equals the single-process
reference over 20 steps, through the path users take (`pool.train` on real engines): the
two built-in models, Hugging Face Llama and GPT-2 (random init from a small config,
byte-level data), and a user's own module, data set and loss.

Global batch 16 everywhere: single 16 x 1, data parallel 2 ranks x 4 x accumulation 2,
tensor parallel and pipelines 8 x 2 (their one replica sees the whole batch).
"""

from __future__ import annotations

import pytest
import torch

import nbpar
from tests.reference.hf import SMALL as HF_SMALL

pytestmark = pytest.mark.timeout(900)

STEPS, SEED = 20, 7
DATA_PARALLEL = [(s, b) for b in ("torch", "deepspeed") for s in ("ddp", "zero1", "zero2", "zero3")]
WHOLE_BATCH = [("tp", "torch"), ("pipeline", "torch"), ("pipeline", "deepspeed")]
_USER = "tests.user_models:"
#: model -> (what its configs share, the strategies beyond data parallel it can run).
MODELS = {
    "tiny_gpt": ({"model": "tiny_gpt"}, WHOLE_BATCH),
    "simple_cnn": ({"model": "simple_cnn"}, []),
    "hf:llama": (
        {"model": "hf:llama", "model_config": HF_SMALL["hf:llama"], "lr": 3e-3},
        WHOLE_BATCH,
    ),
    "hf:gpt2": ({"model": "hf:gpt2", "model_config": HF_SMALL["hf:gpt2"], "lr": 3e-3}, WHOLE_BATCH),
    "user": (
        {
            "model": _USER + "make_model",
            "dataset": _USER + "make_data",
            "loss": _USER + "mse",
            "lr": 1e-2,
        },
        [("zero2", "deepspeed", "optimizer")],
    ),
}


def _losses(pool, **kw) -> torch.Tensor:
    cfg = nbpar.TrainConfig(steps=STEPS, seed=SEED, **kw)
    return torch.tensor(pool.train(cfg).result()["losses"])


@pytest.mark.parametrize("model", list(MODELS))
def test_every_strategy_and_backend_equals_single(pool, model):
    common, more = MODELS[model]
    ref = _losses(pool, strategy="single", micro_batch=16, **common)
    assert ref[-5:].mean() < ref[:5].mean(), "the reference does not learn: a useless comparison"
    for strategy, backend, *offload in DATA_PARALLEL + more:
        whole_batch = strategy in ("tp", "pipeline")
        got = _losses(
            pool,
            strategy=strategy,
            backend=backend,
            micro_batch=8 if whole_batch else 4,
            grad_accum=2,
            offload=offload[0] if offload else "none",
            **common,
        )
        torch.testing.assert_close(
            got,
            ref,
            atol=1e-5,
            rtol=0,
            msg=lambda m: f"{strategy}/{backend} {offload} on {model}: {m}",
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
    plain = _losses(pool, strategy="single", micro_batch=16, lr=3e-3)
    ref = _losses(pool, strategy="single", micro_batch=16, **rule)
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
            got, ref, atol=1e-5, rtol=0, msg=lambda m: f"{strategy}/{backend}: {m}"
        )
