"""Checkpoints: layout, pruning, atomic publish, bad inputs, consolidation, and
resume equality for ddp / tp / zero3 (FSDP2) on 2 real gloo processes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nbpar.checkpoint_meta import LATEST, META, list_checkpoints
from nbpar.config import GPTConfig, TrainConfig
from nbpar.model.models import build_model
from nbpar.train import checkpoint
from nbpar.train.loop import run_training
from tests.distributed import run_distributed

GPT = dict(model="tiny_gpt", seed=1)


def _exact(a, b):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


# ---- one process (strategy single) ------------------------------------------------
@pytest.mark.slow  # 15 training steps, 3 checkpoints
def test_layout_pruning_and_consolidate(tmp_path):
    ck = tmp_path / "ck"
    weights = {}
    res = run_training(
        TrainConfig(
            **GPT,
            strategy="single",
            micro_batch=8,
            steps=15,
            checkpoint_dir=str(ck),
            checkpoint_every=5,
        ),
        on_finish=lambda r: weights.update(
            {k: v.detach().clone() for k, v in r.model.state_dict().items()}
        ),
    )
    assert len(res["losses"]) == 15
    # the newest 2 are kept, latest names the last one, no temp folder left
    assert sorted(os.listdir(ck)) == [LATEST, "step_000010", "step_000015"]
    assert (ck / LATEST).read_text() == "step_000015"
    meta = json.loads((ck / "step_000015" / META).read_text())
    assert meta["step"] == 15 and meta["world_size"] == 1 and meta["global_batch"] == 8
    assert meta["data"] == {"epoch": 0, "samples_in_epoch": 15 * 8}
    assert meta["dims"] == {"pp": 1, "dp": 1, "tp": 1} and meta["format"] == "dcp"

    out = checkpoint.consolidate(str(ck), tmp_path / "export" / "model.pt")
    full = torch.load(out, weights_only=True)
    model = build_model(TrainConfig(**GPT))
    model.load_state_dict(full)  # strict: every key, every shape
    assert set(full) == set(weights)
    for k, v in weights.items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0)


@pytest.mark.slow  # 50 training steps
def test_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    cfg = dict(**GPT, strategy="single", micro_batch=8, checkpoint_dir=str(ck), checkpoint_every=5)
    reference = run_training(TrainConfig(**GPT, strategy="single", micro_batch=8, steps=20))
    promote = checkpoint.promote

    def crash_at_15(root, tmp, final):
        if final.endswith("step_000015"):  # shards and meta.json are written, not promoted
            assert os.path.isfile(os.path.join(tmp, META))
            raise OSError("simulated crash while saving")
        promote(root, tmp, final)

    monkeypatch.setattr(checkpoint, "promote", crash_at_15)
    with pytest.raises(OSError, match="simulated crash"):
        run_training(TrainConfig(**cfg, steps=20))
    monkeypatch.setattr(checkpoint, "promote", promote)
    assert (ck / LATEST).read_text() == "step_000010"
    assert (ck / ".tmp-step_000015").is_dir()
    assert [s for s, _ in list_checkpoints(str(ck))] == [5, 10]

    resumed = run_training(TrainConfig(**cfg, steps=20, resume_from=str(ck)))
    _exact(resumed["losses"], reference["losses"][10:])
    assert [r["step"] for r in resumed["history"]] == list(range(10, 20))
    assert (ck / LATEST).read_text() == "step_000020"
    assert not (ck / ".tmp-step_000015").exists()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 5-step single-process checkpoint to break in different ways."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    run_training(
        TrainConfig(
            **GPT,
            strategy="single",
            micro_batch=8,
            steps=5,
            checkpoint_dir=str(ck),
            checkpoint_every=5,
        )
    )
    return ck


def test_consolidate_to_safetensors_by_suffix(saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    as_pt = torch.load(checkpoint.consolidate(saved, tmp_path / "m.pt"), weights_only=True)
    out = checkpoint.consolidate(saved, tmp_path / "m.safetensors")
    with open(out, "rb") as f:  # safetensors, not a pickle: 8-byte header size, JSON header
        header_len = int.from_bytes(f.read(8), "little")
        assert f.read(1) == b"{" and header_len > 0
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    state = load_file(out)
    assert state.keys() == as_pt.keys()
    for k, v in as_pt.items():
        assert torch.equal(state[k], v), k
    build_model(TrainConfig(**GPT)).load_state_dict(state)  # strict: every key, every shape
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "m.safetensors"]  # no temp file left


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_path_is_refused(tmp_path):
    path = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(path)):
        TrainConfig(**GPT, strategy="single", resume_from=str(path)).validate(1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{empty} is not a checkpoint"):
        TrainConfig(**GPT, strategy="single", resume_from=str(empty)).validate(1)


def test_corrupt_meta_and_pointer_are_refused(saved, tmp_path):
    ck = _copy(saved, tmp_path / "ck")
    (ck / "step_000005" / META).write_text('{"step": 5, "form')
    with pytest.raises(ValueError, match=f"{ck / 'step_000005' / META} is corrupt"):
        TrainConfig(**GPT, strategy="single", resume_from=str(ck)).validate(1)
    (ck / LATEST).write_text("\x00garbage")
    with pytest.raises(ValueError, match="pointer .* is corrupt"):
        TrainConfig(**GPT, strategy="single", resume_from=str(ck)).validate(1)
    (ck / LATEST).write_text("step_000099")
    with pytest.raises(FileNotFoundError, match="step_000099"):
        TrainConfig(**GPT, strategy="single", resume_from=str(ck)).validate(1)


def test_other_model_other_batch_and_no_steps_left_are_refused(saved):
    step = str(saved / "step_000005")
    wide = TrainConfig(**GPT, strategy="single", resume_from=str(saved), gpt=GPTConfig(d_model=64))
    with pytest.raises(
        ValueError,
        match=f"checkpoint at {step} was written by model tiny_gpt "
        f"d_model=32, this config builds d_model=64",
    ):
        wide.validate(1)
    with pytest.raises(ValueError, match="model tiny_gpt, this config builds simple_cnn"):
        TrainConfig(model="simple_cnn", seed=1, strategy="single", resume_from=str(saved)).validate(
            1
        )
    with pytest.raises(ValueError, match="global batch 8, this config has 16"):
        TrainConfig(**GPT, strategy="single", micro_batch=16, resume_from=str(saved)).validate(1)
    with pytest.raises(ValueError, match="global batch 8, this config has 16"):
        TrainConfig(**GPT, strategy="ddp", micro_batch=8, resume_from=str(saved)).validate(2)
    with pytest.raises(ValueError, match="at step 5, so steps=5 leaves nothing"):
        TrainConfig(**GPT, strategy="single", steps=5, resume_from=str(saved)).validate(1)
    with pytest.raises(ValueError, match="checkpoint_keep must be a positive integer"):
        TrainConfig(**GPT, checkpoint_keep=0).validate(1)


def test_bad_resume_fails_before_any_training(saved):
    cfg = TrainConfig(**GPT, strategy="single", micro_batch=4, resume_from=str(saved))
    with pytest.raises(ValueError, match="global batch"):
        run_training(cfg, publish=lambda rec: pytest.fail("a step ran"))


# ---- 2 gloo processes ----------------------------------------------------------
def _resume_equal(rank, world, cfg: dict, ck: str):
    """20 steps saving every 5, then a fresh run resumed from step 10."""
    base = TrainConfig(**cfg, steps=20, checkpoint_dir=ck, checkpoint_every=5, checkpoint_keep=4)
    full = run_training(base)
    resumed = run_training(
        TrainConfig.from_dict(
            {
                **base.to_dict(),
                "checkpoint_dir": ck + "-resumed",
                "resume_from": os.path.join(ck, "step_000010"),
            }
        )
    )
    return {
        "full": full["losses"],
        "resumed": resumed["losses"],
        "steps": [r["step"] for r in resumed["history"]],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout",
    [
        dict(strategy="ddp", micro_batch=4),
        dict(strategy="tp", micro_batch=8),
        dict(strategy="zero3", micro_batch=4),
        dict(strategy="zero1", micro_batch=4),
        dict(strategy="pipeline", micro_batch=4, grad_accum=2),
        dict(strategy="zero2", backend="deepspeed", micro_batch=4),
    ],
    ids=["ddp", "tp", "zero3-fsdp2", "zero1", "pipeline", "deepspeed-zero2"],
)
def test_resume_continues_the_same_loss_curve(layout, tmp_path):
    ck = tmp_path / "ck"
    out = run_distributed(_resume_equal, 2, {**GPT, **layout}, str(ck))
    for r in out:
        assert r["steps"] == list(range(10, 20))
        _exact(r["resumed"], r["full"][10:])
    _exact(out[0]["full"], out[1]["full"])
    assert [s for s, _ in list_checkpoints(str(ck))] == [5, 10, 15, 20]
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck-resumed"))] == [15, 20]
    fmt = "deepspeed" if layout.get("backend") == "deepspeed" else "dcp"
    assert checkpoint.read_meta(str(ck / "step_000020"))["format"] == fmt
    # whatever wrote it, the export is the whole model under its plain names
    full = torch.load(checkpoint.consolidate(ck, tmp_path / "model.pt"), weights_only=True)
    build_model(TrainConfig(**GPT)).load_state_dict(full)
