"""The torchrun recipe (`nbpar.train.ddp_script`) trains what ``strategy="ddp"`` trains:
the script run by torchrun on 2 real gloo processes ends with the same weights, bit for
bit, as nbpar's DDP runner on 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nbpar.config import GPTConfig, TrainConfig
from nbpar.train import ddp_script
from tests.distributed import run_distributed

CFG = dict(
    model="tiny_gpt", strategy="ddp", micro_batch=4, steps=6, lr=3e-3, seed=2, gpt=GPTConfig()
)


def _nbpar_ddp(rank, world, cfg):
    from nbpar.train.loop import run_training

    # the script's rule for threads per process (set by the script itself under torchrun)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out = {}

    def keep(runner):  # as numpy arrays: tensors would go back through shared memory
        out.update({k: v.numpy().copy() for k, v in runner.model.module.state_dict().items()})

    res = run_training(cfg, on_finish=keep)
    return res["losses"], out


def test_write_script_puts_the_recipe_and_its_config_in_a_folder(tmp_path):
    cfg = TrainConfig(**CFG)
    script = ddp_script.write_script(cfg, tmp_path / "job")
    assert script == str(tmp_path / "job" / "train_ddp.py")
    with open(script) as f:
        source = f.read()
    assert "init_process_group" in source and "destroy_process_group" in source
    with open(tmp_path / "job" / "config.json") as f:
        assert TrainConfig.from_dict(json.load(f)) == cfg


@pytest.mark.parametrize(
    "change, word",
    [
        (dict(strategy="zero2"), "strategy"),
        (dict(grad_accum=2), "grad_accum"),
        (dict(precision="bf16"), "precision"),
        (dict(lr_schedule={"type": "WarmupLR"}), "lr_schedule"),
        (dict(checkpoint_dir="ck", checkpoint_every=2), "checkpoint_dir"),
    ],
)
def test_write_script_refuses_what_the_recipe_does_not_do(tmp_path, change, word):
    with pytest.raises(ValueError, match=word):
        ddp_script.write_script(TrainConfig(**{**CFG, **change}), tmp_path)
    assert not os.listdir(tmp_path)


@pytest.mark.timeout(240)
def test_torchrun_script_ends_with_the_weights_of_nbpar_ddp(tmp_path):
    cfg = TrainConfig(**CFG)
    script = ddp_script.write_script(cfg, tmp_path)
    out = tmp_path / "weights.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, script, "--out", str(out)], capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("step ") for line in lines) == 2  # rank 0 only: steps 0 and 5
    script_losses = json.loads(lines[-1])["losses"]
    script_weights = torch.load(out, weights_only=True)

    (losses, weights), (losses1, _) = run_distributed(_nbpar_ddp, 2, cfg.to_dict())
    assert losses == losses1 and len(losses) == cfg.steps
    assert script_losses == losses
    assert script_weights.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(script_weights[name], torch.from_numpy(w)), name
