"""Pipeline x tensor x data parallel (2-D and 3-D) against one process.

The reported loss of a step (mean over dp replicas of the pipeline's loss)
must equal single-process training on the same global batch.
"""

from __future__ import annotations

import pytest
import torch

from nbpar.dims import ParallelDims
from nbpar.parallel import hybrid
from tests.distributed import run_distributed
from tests.reference.gpt import (
    ACCUM,
    MICRO,
    batches,
    build_mesh,
    lm_loss,
    make_cfg,
    make_model,
    single_losses,
)


def _train_hybrid(rank, world, dims, variants, steps):
    """Train each variant (cfg overrides); this rank's losses per variant."""
    mesh = build_mesh(world, **dims)
    coords = ParallelDims(world_size=world, **dims).coords(rank)
    dp, j = dims.get("dp", 1), coords["dp"]
    out = {}
    for variant in variants:
        cfg = make_cfg(strategy="hybrid", **variant)
        runner = hybrid.build_runner(make_model(), cfg, mesh, loss_fn=lm_loss)
        losses = []
        for s in range(steps):
            # dp replica j takes slice j of every global micro-batch (like DistributedSampler)
            mine = [
                (x[j * MICRO : (j + 1) * MICRO], y[j * MICRO : (j + 1) * MICRO])
                for x, y in batches(s, ACCUM, MICRO * dp)
            ]
            losses.append(runner.train_step(mine).item())
        out[str(variant)] = losses
    return coords, out


def check_against_single(results, dims, steps):
    dp = dims.get("dp", 1)
    ref = torch.tensor(single_losses(steps, ACCUM, MICRO * dp))
    variants = results[0][1].keys()
    for variant in variants:
        per_dp = {}
        for coords, out in results:
            per_dp.setdefault(coords["dp"], []).append(torch.tensor(out[variant]))
        for same_replica in per_dp.values():  # every pp/tp rank reports the same loss
            for t in same_replica[1:]:
                torch.testing.assert_close(t, same_replica[0], atol=1e-6, rtol=0)
        got = torch.stack([v[0] for v in per_dp.values()]).mean(0)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=lambda m: f"{variant}: {m}")


@pytest.mark.timeout(240)
def test_dp2_pp2_ddp_and_fsdp_match_single():
    dims, steps = dict(dp=2, pp=2), 20
    variants = [dict(schedule="1f1b"), dict(schedule="gpipe", fsdp_reshard=True)]
    results = run_distributed(_train_hybrid, 4, dims, variants, steps, timeout=230)
    check_against_single(results, dims, steps)


@pytest.mark.timeout(240)
def test_pp2_tp2_interleaved_matches_single():
    dims, steps = dict(pp=2, tp=2), 20
    results = run_distributed(
        _train_hybrid, 4, dims, [dict(schedule="interleaved")], steps, timeout=230
    )
    check_against_single(results, dims, steps)


@pytest.mark.timeout(240)
def test_3d_dp2_tp2_pp2_fsdp_matches_single():
    # 8 processes on a 2-core machine: 6 steps keep it near a minute; FSDP2 (ZeRO-2)
    # on tensor-parallel stages is the torchtitan 3-D recipe
    dims, steps = dict(dp=2, tp=2, pp=2), 6
    results = run_distributed(
        _train_hybrid, 8, dims, [dict(schedule="1f1b", fsdp_reshard=False)], steps, timeout=230
    )
    check_against_single(results, dims, steps)


@pytest.mark.timeout(240)
def test_deepspeed_dp2_pp2_matches_single():
    dims, steps = dict(dp=2, pp=2), 6
    results = run_distributed(
        _train_hybrid, 4, dims, [dict(backend="deepspeed")], steps, timeout=230
    )
    check_against_single(results, dims, steps)
