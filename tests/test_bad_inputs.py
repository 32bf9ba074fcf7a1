"""The bad-input table: each bad input gets one clear error before any engine works."""

from __future__ import annotations

import json
import socket

import pytest

import nbpar
from nbpar.config import GPTConfig, TrainConfig
from tests.distributed import children

POOL_CASES = [
    (dict(n=0), ValueError, "Pool size must be a positive integer, got 0"),
    (dict(n=-1), ValueError, "Pool size must be a positive integer, got -1"),
    (dict(n=True), ValueError, "positive integer"),
    (dict(n=1.5), ValueError, "positive integer"),
    (dict(n="2"), ValueError, "positive integer"),
    (dict(n=2, launcher="carrier-pigeon"), ValueError, "unknown launcher 'carrier-pigeon'.*local"),
    (dict(n=2, backend="nccl"), ValueError, "GPU"),
    (dict(n=2, backend="ucc"), ValueError, "backend must be one of"),
    (dict(n=2, timeout=-5), ValueError, "timeout must be positive"),
    (dict(n=2, port=70000), ValueError, "port must be an integer in 1..65535"),
]


@pytest.mark.parametrize("kwargs, exc, match", POOL_CASES)
def test_pool_bad_inputs_start_nothing(kwargs, exc, match):
    before = children()
    n = kwargs.pop("n")
    with pytest.raises(exc, match=match):
        nbpar.Pool(n, **kwargs)
    assert children() <= before


def test_pool_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {busy} is already in use"):
            nbpar.Pool(2, port=busy)


# (what tests/test_config.py's table already covers is not repeated here)
CONFIG_CASES = [
    (dict(strategy="zero4"), "strategy"),
    (dict(backend="jax"), "backend"),
    (dict(precision="fp8"), "precision"),
    (
        dict(
            strategy="pipeline",
            backend="deepspeed",
            deepspeed_config={"zero_optimization": {"stage": 3}},
        ),
        "stage 0 or 1",
    ),
    (dict(strategy="hybrid", dp=2, tp=2), r"dp\*tp\*pp"),
    (dict(strategy="pipeline", gpt=GPTConfig(n_layers=1)), "need at least 2 layers"),
    (dict(strategy="pipeline", schedule="1f1b", grad_accum=1), "at least as many micro-batches"),
    (
        dict(strategy="pipeline", schedule="interleaved", grad_accum=4, gpt=GPTConfig(n_layers=3)),
        "needs 4 layers",
    ),
    (
        dict(strategy="pipeline", schedule="dualpipev", grad_accum=3, gpt=GPTConfig(n_layers=4)),
        "'dualpipev' needs at least one micro-batch per stage",
    ),
    (dict(strategy="pipeline", schedule="zbv", gpt=GPTConfig(n_layers=3)), "needs 4 layers"),
    (
        dict(
            backend="deepspeed",
            strategy="zero3",
            micro_batch=8,
            deepspeed_config={"train_micro_batch_size_per_gpu": 16},
        ),
        "train_micro_batch_size_per_gpu=16.*8",
    ),
    (
        dict(backend="deepspeed", strategy="zero3", deepspeed_config={"zero_optimisation": {}}),
        "did you mean 'zero_optimization'",
    ),
    (
        dict(
            backend="deepspeed",
            strategy="zero3",
            deepspeed_config={
                "zero_optimization": {"stage": 3, "offload_param": {"device": "floppy"}}
            },
        ),
        "floppy",
    ),
    (  # a style DeepSpeed's own examples use; it asserted deep inside DeepSpeed
        dict(
            backend="deepspeed",
            strategy="zero2",
            precision="bf16",
            offload="optimizer",
            deepspeed_config={
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            },
        ),
        "bf16.bf16_master_weights_and_grads.*DeepSpeedCPUAdam.*remove",
    ),
]


@pytest.mark.parametrize("kwargs, match", CONFIG_CASES)
def test_train_config_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs).validate(2)


def test_deepspeed_config_file_with_bad_json_names_the_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 8,\n  "zero_optimization": {stage: 3}}')
    with pytest.raises(ValueError, match="ds_config.json"):
        TrainConfig(backend="deepspeed", strategy="zero3", deepspeed_config=str(path)).validate(2)


@pytest.mark.parametrize("has_fp16", [True, False])
def test_classic_ds_config_is_accepted_as_written(tmp_path, half_precision, has_fp16):
    half_precision(fp16=has_fp16)
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "fp16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    cfg = TrainConfig(
        backend="deepspeed",
        strategy="zero3",
        precision="fp16",
        offload="optimizer",
        micro_batch=8,
        deepspeed_config=str(path),
    )
    if has_fp16:
        cfg.validate(2)
    else:  # a hardware limit: refused in one line that names the way out
        with pytest.raises(
            ValueError, match="fp16.*needs AVX512-FP16 or AMX-FP16.*use precision 'bf16'"
        ):
            cfg.validate(2)


def test_pool_train_refuses_bad_config_without_engine_work():
    class NoEngines:
        n = 2

        def _check_open(self):
            pass

    from nbpar.pool.run import start_run

    with pytest.raises(ValueError, match="micro_batch"):
        start_run(NoEngines(), TrainConfig(micro_batch=-1))
