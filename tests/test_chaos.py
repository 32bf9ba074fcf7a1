"""Chaos, short: SIGKILL a random engine at a random step three times during a
checkpointed pool.train on a Pool(restart="auto"); the stitched loss curve equals an
uninterrupted run's."""

from __future__ import annotations

import pytest
import torch

import nbpar
from nbpar.bench.engine_kills import chaos_train
from nbpar.config import TrainConfig

pytestmark = pytest.mark.timeout(600)


def test_three_kills_resume_from_the_last_checkpoint_with_the_same_losses(tmp_path):
    base = dict(model="tiny_gpt", seed=3, strategy="ddp", micro_batch=4, steps=30)
    with nbpar.Pool(2, restart="auto", replace=False) as pool:
        reference = pool.train(TrainConfig(**base)).result()["losses"]
        cfg = TrainConfig(**base, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3)
        out = chaos_train(pool, cfg, kills=3, seed=7)
    assert len(out["kills"]) == 3
    for kill in out["kills"]:
        assert kill["resumed_from"] % 3 == 0 and kill["resumed_from"] <= kill["step"]
        assert kill["recovery_s"] < 60 and kill["lost_s"] >= kill["recovery_s"] - 1
    torch.testing.assert_close(
        torch.tensor(out["losses"]), torch.tensor(reference), atol=1e-6, rtol=0
    )


def test_chaos_needs_auto_restart_and_checkpoints(pool, tmp_path):
    cfg = TrainConfig(model="tiny_gpt", steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(ValueError, match="restart='auto'"):
        chaos_train(pool, cfg, kills=1)
