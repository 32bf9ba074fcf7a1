"""ds_config checking and building: client side, no torch or deepspeed needed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import types

import pytest

from nbpar.parallel.ds_config import ds_config_for, validate_ds_config

CLASSIC = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}


def cfg(**kw):
    fields = dict(
        strategy="zero3",
        micro_batch=8,
        grad_accum=1,
        precision="fp16",
        offload="optimizer",
        lr=1e-3,
        optimizer="adam",
        deepspeed_config=None,
        optimizer_params=None,
        grad_clip=0.0,
        lr_schedule=None,
        steps=20,
    )
    return types.SimpleNamespace(**{**fields, **kw})


def test_classic_config_validates_as_written(tmp_path):
    assert validate_ds_config(CLASSIC) == CLASSIC
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CLASSIC))
    assert validate_ds_config(str(path)) == CLASSIC


def test_typo_keys_get_did_you_mean():
    want = (
        "unknown DeepSpeed config key 'train_micro_batch_size_per_gp' "
        "\\(did you mean 'train_micro_batch_size_per_gpu'\\?\\)"
    )
    with pytest.raises(ValueError, match=want):
        validate_ds_config({"train_micro_batch_size_per_gp": 8})
    bad = copy.deepcopy(CLASSIC)
    bad["zero_optimization"]["ofload_optimizer"] = bad["zero_optimization"].pop("offload_optimizer")
    with pytest.raises(
        ValueError,
        match="'ofload_optimizer' in zero_optimization \\(did you mean 'offload_optimizer'\\?\\)",
    ):
        validate_ds_config(bad)


def test_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": tru}\n}\n')
    with pytest.raises(ValueError, match="broken.json.*line 3"):
        validate_ds_config(str(path))
    with pytest.raises(ValueError, match="missing.json"):
        validate_ds_config(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="dict or a path"):
        validate_ds_config(3)


def test_bad_values_rejected():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        validate_ds_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match="offload_param.device.*'gpu'"):
        validate_ds_config({"zero_optimization": {"offload_param": {"device": "gpu"}}})


def test_classic_config_built_for_matching_train_config():
    d = ds_config_for(cfg(deepspeed_config=copy.deepcopy(CLASSIC)), dp_size=2)
    assert d["train_batch_size"] == 16
    assert d["zero_optimization"]["stage"] == 3
    assert d["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert d["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert d["zero_force_ds_cpu_optimizer"] is False
    assert d["zero_allow_untested_optimizer"] is True  # ZeRO with torch.optim.SGD
    assert d["optimizer"] == {"type": "Adam", "params": {"lr": 1e-3}}
    assert d["fp16"] == {"enabled": True}
    validate_ds_config(d)  # what we add is itself a valid DeepSpeed config


def test_config_from_train_config_alone():
    d = ds_config_for(
        cfg(
            strategy="zero1",
            micro_batch=4,
            grad_accum=2,
            precision="bf16",
            offload="none",
            lr=0.01,
            optimizer="sgd",
        ),
        dp_size=2,
    )
    assert d["train_micro_batch_size_per_gpu"] == 4
    assert d["gradient_accumulation_steps"] == 2 and d["train_batch_size"] == 16
    assert d["zero_optimization"] == {"stage": 1}
    assert d["bf16"] == {"enabled": True} and "fp16" not in d
    assert d["optimizer"] == {"type": "SGD", "params": {"lr": 0.01}}


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(micro_batch=4), "train_micro_batch_size_per_gpu=8.*4"),
        (dict(strategy="zero1"), "stage=3.*1"),
        (dict(precision="bf16"), "fp16.*bf16"),
        (dict(offload="none"), "offload_optimizer.*'none'"),
        (dict(lr=0.1), "lr=0.001.*0.1"),
        (dict(optimizer="sgd"), "optimizer type 'Adam'.*sgd"),
    ],
)
def test_conflicts_with_train_config_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        ds_config_for(cfg(deepspeed_config=copy.deepcopy(CLASSIC), **kw), dp_size=2)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(
                strategy="pipeline",
                precision="fp32",
                offload="none",
                deepspeed_config={"zero_optimization": {"stage": 2}},
            ),
            "stage 0 or 1",
        ),
        (dict(strategy="zero2", offload="params"), "parameter offload needs ZeRO stage 3"),
        (dict(strategy="ddp", offload="optimizer"), "stage 1, 2 or 3"),
        (
            dict(deepspeed_config={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}),
            "NVMe",
        ),
        (dict(deepspeed_config={"optimizer": {"type": "Lamb"}}), "compiled ops"),
        (dict(deepspeed_config={"train_batch_size": 99}), "train_batch_size=99"),
    ],
)
def test_unsupported_combinations_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        ds_config_for(cfg(**kw), dp_size=2)


def test_params_offload_offloads_optimizer_too():
    zero = ds_config_for(cfg(offload="params"), dp_size=1)["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu"}
    assert zero["offload_optimizer"] == {"device": "cpu"}


def test_module_import_stays_light():
    code = (
        "import sys, nbpar.parallel.ds_config; "
        "print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(__import__("pathlib").Path(__file__).parents[1]),
    )
    assert out.stdout.split() == ["False", "False"]


def test_every_zero_key_deepspeed_reads_is_accepted():
    """ZERO_KEYS holds every field and alias of the installed DeepSpeed's
    DeepSpeedZeroConfig, so no key DeepSpeed reads is refused as a typo."""
    code = (
        "import os, json; os.environ.setdefault('DS_ACCELERATOR', 'cpu'); "
        "from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as C; "
        "print(json.dumps(sorted({n for name, f in C.model_fields.items() "
        "for n in (name, f.alias) if n})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    deepspeed_reads = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert len(deepspeed_reads) > 40  # the model's fields really were read
    from nbpar.parallel.ds_keys import ZERO_KEYS

    assert deepspeed_reads - set(ZERO_KEYS) == set()
