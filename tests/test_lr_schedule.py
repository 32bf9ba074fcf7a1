"""nbpar's schedules (used by the torch strategies and the single-process reference)
against DeepSpeed's own scheduler classes, step by step."""

from __future__ import annotations

import pytest
import torch

from nbpar.model.lr_schedule import Schedule, resolve

SECTIONS = [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 7}},
    {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
    },
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 6}},
    {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 25,
            "warmup_max_lr": 2e-3,
            "warmup_num_steps": 1,
            "warmup_type": "linear",
        },
    },
    {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 30, "warmup_num_steps": 4, "warmup_min_ratio": 0.1},
    },
    {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 6,
            "decay_lr_rate": 0.5,
            "decay_step_size": 3,
            "decay_mom_rate": 0.1,
        },
    },
    {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 5,
            "cycle_second_step_size": 3,
            "cycle_first_stair_count": 2,
        },
    },
]


@pytest.mark.spawn  # DeepSpeed's first look at its ops runs gcc (the libaio probe)
@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s["type"])
def test_schedule_equals_deepspeed_step_by_step(section):
    from nbpar.parallel.deepspeed import import_deepspeed

    lr_schedules = import_deepspeed().runtime.lr_schedules
    base_lr = 1e-3
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    theirs = getattr(lr_schedules, section["type"])(opt, **section["params"])
    ours = Schedule(resolve(section, base_lr, steps=30), base_lr)
    for it in range(-1, 40):  # it = -1: as built, before any step
        if it >= 0:
            theirs.step()
        group = opt.param_groups[0]
        assert ours.lr(it) == pytest.approx(group["lr"], rel=1e-12, abs=1e-15), it
        want = group["betas"] if section["type"] == "OneCycle" else None
        assert ours.betas(it) == (None if want is None else pytest.approx(want)), it


@pytest.mark.parametrize(
    "section, match",
    [
        ({"type": "CosineAnnealing"}, "not supported; choose one of WarmupLR"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "no parameter warmup_steps"),
        ({"type": "WarmupDecayLR", "params": {}}, "needs params.total_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "positive integer, got 0"),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1}},
            "cycle_min_lr='auto' has no TrainConfig value",
        ),
        ("WarmupLR", "must be {'type'"),
    ],
)
def test_bad_schedules_are_refused_in_one_line(section, match):
    with pytest.raises(ValueError, match=match):
        resolve(section, 1e-3, 10)


def test_auto_takes_the_train_config():
    got = resolve(
        {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        lr=5e-3,
        steps=40,
    )
    assert got["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-3,
        "warmup_num_steps": 4,
        "total_num_steps": 40,
    }
