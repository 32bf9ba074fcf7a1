"""Resume on another layout (DCP resharding) and after a real SIGKILL of an engine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import nbpar
from nbpar.checkpoint_meta import LATEST, read_meta
from nbpar.config import TrainConfig
from nbpar.train.loop import run_training
from tests.distributed import run_distributed

GPT = dict(model="tiny_gpt", seed=2)


def _close(a, b, atol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def _save_then_reshard(rank, world, layout: dict, ck: str, resumed_as: dict):
    """``layout`` trains 20 steps saving every 10; ``resumed_as`` continues from step 10
    on the same 2 ranks (another strategy, same global batch)."""
    full = run_training(
        TrainConfig(**GPT, **layout, steps=20, checkpoint_dir=ck, checkpoint_every=10)
    )
    other = run_training(
        TrainConfig(**GPT, **resumed_as, steps=20, resume_from=os.path.join(ck, "step_000010"))
    )
    return {"full": full["losses"], "other": other["losses"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "saved_by,resumed_as",
    [
        (dict(strategy="ddp", micro_batch=4), dict(strategy="zero3", micro_batch=4)),
        (dict(strategy="tp", micro_batch=8), dict(strategy="ddp", micro_batch=4)),
    ],
    ids=["ddp->zero3+single", "tp->ddp+single"],
)
def test_resume_on_another_layout(saved_by, resumed_as, tmp_path):
    """Saved on 2 ranks, continued on 2 ranks of another strategy and on 1 process."""
    ck = str(tmp_path / "ck")
    out = run_distributed(_save_then_reshard, 2, saved_by, ck, resumed_as)
    full = out[0]["full"]
    for r in out:
        _close(r["other"], full[10:], atol=1e-5)
    assert read_meta(os.path.join(ck, "step_000010"))["world_size"] == 2
    # 2 ranks -> one process: micro_batch x dp stays 8, so the global batch is the same
    single = run_training(
        TrainConfig(
            **GPT,
            strategy="single",
            micro_batch=8,
            steps=20,
            resume_from=os.path.join(ck, "step_000010"),
        )
    )
    _close(single["losses"], full[10:], atol=1e-5)


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_sigkill_an_engine_then_resume_on_a_restarted_pool(pool, tmp_path):
    ck = tmp_path / "ck"
    base = dict(**GPT, strategy="ddp", micro_batch=4)
    run = pool.train(TrainConfig(**base, steps=1000, checkpoint_dir=str(ck)), checkpoint_every=5)
    _wait_for(
        lambda: (ck / "step_000010" / "meta.json").exists() or run.done(),
        120,
        "the step-10 checkpoint",
    )
    assert not run.done()
    os.kill(pool.status()[1]["pid"], signal.SIGKILL)
    with pytest.raises(nbpar.EngineDied):
        run.wait(timeout=120)
    # whatever the kill interrupted, latest names a complete checkpoint
    step = read_meta(str(ck / (ck / LATEST).read_text()))["step"]
    assert step >= 10 and step % 5 == 0

    pool.restart()
    resumed = pool.train(
        TrainConfig(
            **base, steps=step + 6, checkpoint_dir=str(ck), checkpoint_every=5, resume_from=str(ck)
        )
    ).result()
    reference = pool.train(TrainConfig(**base, steps=step + 6)).result()
    assert len(resumed["losses"]) == 6
    _close(resumed["losses"], reference["losses"][step:], atol=1e-6)


def test_bad_resume_is_refused_before_any_engine_works(pool, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "gone")):
        pool.train(TrainConfig(**GPT, resume_from=str(tmp_path / "gone")))
    assert [r["state"] for r in pool.status()] == ["ready", "ready"]
