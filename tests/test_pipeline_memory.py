"""Peak activation memory per pipeline stage: GPipe holds m micro-batches, 1F1B fewer.

Stage 0 of p=2 with m=4: GPipe (Huang et al. 2019) runs all four forwards
before any backward, so its peak is four micro-batches' saved activations;
1F1B (PipeDream-Flush, Narayanan et al. 2021) keeps at most p in flight. The per-micro-batch
reference is counted independently, in one process, on a plain forward.
"""

from __future__ import annotations

import pytest
from torch.autograd.graph import saved_tensors_hooks

from nbpar.model.models import next_token_loss as lm_loss
from nbpar.parallel import pipeline
from tests.distributed import run_distributed
from tests.reference.gpt import ACCUM, batches, build_mesh, make_cfg, make_model


def one_microbatch_bytes() -> int:
    """Bytes stage 0 saves for backward on one micro-batch, outside any pipeline."""
    stage0 = pipeline.split_stages(make_model(), 0, 2)[0]
    params = {p.untyped_storage().data_ptr() for p in stage0.parameters()}
    seen: set = set()

    def pack(t):
        seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    x, _ = batches(0)[0]
    with saved_tensors_hooks(pack, lambda t: t):
        stage0(x.clone())  # own storage: one micro-batch of token ids
    return sum(n for ptr, n in seen if ptr not in params)


def _peaks(rank, world):
    mesh = build_mesh(world, pp=world)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        runner = pipeline.build_runner(
            make_model(), make_cfg(schedule=schedule), mesh, loss_fn=lm_loss
        )
        for s in range(2):
            runner.train_step(batches(s))
        out[schedule] = dict(
            peak=runner.peak_activation_bytes(),
            record=runner.memory()["activation_peak_bytes"],
            live=runner.activations.live_bytes(),
        )
    return out


@pytest.mark.timeout(240)
def test_gpipe_holds_all_microbatches_1f1b_fewer():
    ranks = run_distributed(_peaks, 2, timeout=200)
    stage0 = ranks[0]
    one = one_microbatch_bytes()
    assert one > 0
    gpipe, f1b = stage0["gpipe"]["peak"], stage0["1f1b"]["peak"]
    assert gpipe == pytest.approx(ACCUM * one, rel=0.10)
    assert gpipe > f1b
    assert f1b <= 2 * one * 1.10  # at most p = 2 micro-batches in flight on stage 0
    for rank in ranks:
        for res in rank.values():
            assert res["record"] == res["peak"]  # what train.py's step record carries
            assert res["live"] == 0  # every backward released its micro-batch
            assert res["peak"] > 0
