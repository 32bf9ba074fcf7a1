"""Memory is returned: consecutive runs in one pool do not grow the engines' RSS.

Each run builds a model, a strategy (DDP reducer, DeepSpeed engine), DeviceMesh
sub-groups and a loader; all of it must be released when the run ends.
"""

from __future__ import annotations

import pytest

import nbpar
from nbpar.config import GPTConfig

RUNS = 10
MAX_GROWTH = 0.05
# wide enough that one leaked run (params, grads, Adam state: ~8 MiB) shows against
# an engine's ~400 MiB baseline: 8 leaked runs would be ~15 %
GPT = GPTConfig(d_model=128, n_heads=4, n_layers=2)


def _rss_after_each_run(pool, cfg) -> list[list[int]]:
    rows = []
    for _ in range(RUNS):
        res = pool.train(cfg).result()
        assert len(res["losses"]) == cfg.steps
        rows.append([r["memory"] for r in pool.status()])
    return rows


def _assert_flat(rows, what):
    warm, last = rows[1], rows[-1]  # run 1 loads the libraries and data once
    print(what, [[round(v / 2**20, 1) for v in r] for r in rows])
    for rank, (a, b) in enumerate(zip(warm, last)):
        assert a and b, f"no RSS for rank {rank}"
        growth = (b - a) / a
        assert growth < MAX_GROWTH, (
            f"{what}: rank {rank} RSS grew {growth:.1%} from run 2 to run {RUNS} "
            f"({a / 2**20:.1f} -> {b / 2**20:.1f} MiB); per run: "
            f"{[round(r[rank] / 2**20, 1) for r in rows]}"
        )


@pytest.mark.timeout(300)
def test_ddp_runs_return_their_memory(pool):
    cfg = nbpar.TrainConfig(model="tiny_gpt", gpt=GPT, strategy="ddp", micro_batch=4, steps=5)
    _assert_flat(_rss_after_each_run(pool, cfg), "ddp")


@pytest.mark.timeout(300)
def test_deepspeed_runs_return_their_memory(pool):
    cfg = nbpar.TrainConfig(
        model="tiny_gpt", gpt=GPT, strategy="zero2", backend="deepspeed", micro_batch=4, steps=5
    )
    _assert_flat(_rss_after_each_run(pool, cfg), "deepspeed zero2")
