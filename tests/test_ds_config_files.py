"""ds_config files as people write them (tests/ds_configs), used as written.

What the TrainConfig does not set comes from the file; "auto" is filled from the
TrainConfig; legacy keys work; schedulers and clipping run and the single-process
reference runs them too; fp16 runs where the hardware has it and is refused in one
line where it does not.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import nbpar
from nbpar import device

pytestmark = pytest.mark.timeout(600)

CONFIGS = pathlib.Path(__file__).parent / "ds_configs"
STEPS = 12
RUNNABLE = {  # file -> what the TrainConfig takes from it
    "legacy_cpu_offload.json": dict(
        strategy="zero2",
        micro_batch=4,
        grad_accum=2,
        offload="optimizer",
        optimizer="adamw",
        lr=5e-4,
    ),
    "huggingface_auto.json": dict(
        strategy="zero3",
        micro_batch=8,
        grad_accum=1,
        offload="params",
        precision="fp32",
        optimizer="adamw",
    ),
    "train_batch_size_only.json": dict(strategy="zero1", micro_batch=16, grad_accum=1),
    "scheduler_and_clipping.json": dict(
        strategy="zero3", micro_batch=8, grad_clip=0.5, lr=2e-3, optimizer="adamw"
    ),
}


def reference_of(cfg: nbpar.TrainConfig, world: int) -> nbpar.TrainConfig:
    """The single-process run with the same global batch and update rule."""
    d = cfg.to_dict()
    d.update(
        strategy="single",
        backend="torch",
        deepspeed_config=None,
        offload="none",
        dp=None,
        micro_batch=cfg.global_batch(world),
        grad_accum=1,
    )
    return nbpar.TrainConfig.from_dict(d)


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_config_file_trains_as_written_and_equals_reference(pool, name):
    cfg = nbpar.TrainConfig(deepspeed_config=str(CONFIGS / name), steps=STEPS)
    cfg = cfg.validate(2)  # the checked copy: train_batch_size may decide a size
    assert cfg.backend == "deepspeed"
    for field, want in RUNNABLE[name].items():
        assert getattr(cfg, field) == want, field
    got = pool.train(cfg).result()["losses"]
    ref = pool.train(reference_of(cfg, 2)).result()["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-5, rtol=0)


def test_explicit_settings_fill_auto_and_real_conflicts_are_refused():
    path = str(CONFIGS / "huggingface_auto.json")
    cfg = nbpar.TrainConfig(
        deepspeed_config=path, micro_batch=2, grad_accum=3, lr=1e-2, precision="bf16", grad_clip=1.0
    ).validate(2)
    from nbpar.parallel.ds_config import ds_config_for

    d = ds_config_for(cfg, 2)
    assert (
        d["train_micro_batch_size_per_gpu"],
        d["gradient_accumulation_steps"],
        d["train_batch_size"],
    ) == (2, 3, 12)
    assert d["bf16"]["enabled"] is True and d["fp16"]["enabled"] is False
    assert d["optimizer"]["params"] == {"lr": 1e-2} and d["gradient_clipping"] == 1.0
    assert d["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-2,
        "warmup_num_steps": 2,
    }
    assert "reduce_bucket_size" not in d["zero_optimization"]
    with pytest.raises(ValueError, match="stage=2 but the TrainConfig asks for 3"):
        nbpar.TrainConfig(
            deepspeed_config=str(CONFIGS / "legacy_cpu_offload.json"), strategy="zero3"
        ).validate(2)
    with pytest.raises(
        ValueError, match="train_batch_size=32 is not a multiple of grad_accum=3 x dp=2"
    ):
        nbpar.TrainConfig(
            deepspeed_config=str(CONFIGS / "train_batch_size_only.json"), grad_accum=3
        ).validate(2)


def nbpar_cli(*args, timeout=400):
    return subprocess.run(
        [sys.executable, "-m", "nbpar", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_trains_a_config_file_with_no_other_training_flags(pool):
    path = str(CONFIGS / "scheduler_and_clipping.json")
    out = nbpar_cli(
        "train", "--backend", "deepspeed", "--deepspeed-config", path, "--engines", "2", "--json"
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["config"]["strategy"] == "zero3" and doc["config"]["grad_clip"] == 0.5
    cfg = nbpar.TrainConfig(deepspeed_config=path).validate(2)
    assert len(doc["losses"]) == cfg.steps == 20
    ref = pool.train(reference_of(cfg, 2)).result()["losses"]
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref), atol=1e-5, rtol=0)


def test_fp16_config_runs_where_the_cpu_has_fp16_else_one_line_refusal(pool):
    path = str(CONFIGS / "fp16_dynamic_loss_scale.json")
    if not device.half_precision_support("gloo")["fp16"]:
        out = nbpar_cli("train", "--deepspeed-config", path, "--engines", "2", "--json")
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "needs AVX512-FP16 or AMX-FP16" in lines[0], out.stderr
        with pytest.raises(ValueError, match="use precision 'bf16'"):
            pool.train(nbpar.TrainConfig(deepspeed_config=path))
        return
    cfg = nbpar.TrainConfig(deepspeed_config=path, steps=STEPS).validate(2)
    assert cfg.precision == "fp16" and cfg.optimizer_params["weight_decay"] == 3e-7
    got = pool.train(cfg).result()["losses"]
    ref_cfg = reference_of(cfg, 2)
    ref_cfg.precision = "fp32"
    ref = pool.train(ref_cfg).result()["losses"]
    # fp16 compute with fp32 master weights and dynamic loss scaling against fp32: the
    # tiny MLP of tests/test_deepspeed.py measured 6e-5 on an AMX machine; tiny_gpt's
    # longer sums are given 2e-2 (not yet measured: no fp16 CPU was at hand)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-2, rtol=0)
    assert max(abs(a - b) for a, b in zip(got, ref)) > 1e-7  # fp16 really ran
