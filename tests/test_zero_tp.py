"""ZeRO/FSDP on the dp dimension combined with tensor parallel, through TrainConfig
(its degrees: tests/test_config.py; the runner against a reference: tests/test_tensor.py)."""

from __future__ import annotations

import pytest
import torch

from nbpar.config import TrainConfig
from nbpar.train.loop import run_training
from tests.distributed import run_distributed

STEPS = 6


def _train(rank, world, strategy):
    cfg = TrainConfig(model="tiny_gpt", strategy=strategy, tp=2, micro_batch=4, steps=STEPS)
    out = run_training(cfg)
    return out["losses"], out["param_bytes"]


@pytest.mark.timeout(300)
def test_zero3_with_tp_matches_single_and_shards_params():
    ref = run_training(TrainConfig(model="tiny_gpt", strategy="single", micro_batch=8, steps=STEPS))
    results = run_distributed(_train, 4, "zero3")
    for losses, param_bytes in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=0
        )
        # dp=2 x tp=2: each rank keeps about a quarter of the sharded weights
        assert param_bytes < ref["param_bytes"] / 2


def _three_runs(rank, world):
    out = []
    for kwargs in (
        dict(strategy="hybrid", dp=2, tp=2),
        dict(strategy="zero3", tp=2),
        dict(strategy="hybrid", dp=2, tp=2),
    ):
        cfg = TrainConfig(model="tiny_gpt", micro_batch=4, steps=2, **kwargs)
        out.append(run_training(cfg)["losses"])
    return out


@pytest.mark.timeout(300)
def test_consecutive_runs_with_sub_groups_in_one_process_group():
    # a second mesh of the same layout used to hit groups destroyed after the first run
    results = run_distributed(_three_runs, 4)
    for first, second, third in results:
        torch.testing.assert_close(torch.tensor(first), torch.tensor(third), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(first), torch.tensor(second), atol=1e-5, rtol=0)
