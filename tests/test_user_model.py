"""A user's own module, data set and loss: given as callables or registered names they
train like strings, and bad input is refused in one line before any engine works.
That every data-parallel strategy and backend equals the single-process reference is
tests/test_equivalence.py's table, the user model included."""

from __future__ import annotations

import pytest
import torch

import nbpar
from nbpar.probe import check_fits, check_model
from tests import user_models

pytestmark = pytest.mark.timeout(900)

M = "tests.user_models:"
USER = dict(model=M + "make_model", dataset=M + "make_data", loss=M + "mse")
STEPS, SEED = 20, 3


def _losses(pool, **kw) -> torch.Tensor:
    cfg = nbpar.TrainConfig(steps=STEPS, seed=SEED, lr=1e-2, **kw)
    return torch.tensor(pool.train(cfg).result()["losses"])


def test_callables_and_registered_names_train_like_strings(pool):
    """The factory given as a function and as a registered name ships to the engines."""
    ref = _losses(pool, strategy="single", micro_batch=16, model_config={"width": 16}, **USER)
    got = _losses(
        pool,
        strategy="zero3",
        micro_batch=8,
        model=user_models.make_model,
        model_config={"width": 16},
        dataset=user_models.make_data,
        loss=user_models.mse,
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    nbpar.register_model("my_net", M + "make_model", dataset=M + "make_data", loss=M + "mse")
    got = _losses(pool, strategy="ddp", micro_batch=8, model="my_net", model_config={"width": 16})
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_bf16_trains_a_user_module(pool):
    losses = _losses(pool, strategy="zero2", micro_batch=8, precision="bf16", **USER)
    assert torch.isfinite(losses).all() and losses[-5:].mean() < losses[:5].mean()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(model=M + "raises"),
            "model factory tests.user_models:raises raised RuntimeError: weights file missing",
        ),
        (dict(model=M + "not_a_module"), "returned str, not a torch.nn.Module"),
        (dict(model="tests.no_such_module:f"), "cannot import 'tests.no_such_module'"),
        (dict(model=M + "no_such_function"), "has no 'no_such_function'"),
        (
            dict(dataset=M + "wrong_shape_data"),
            r"input \(16, 5\) float32\) does not fit model "
            r"tests.user_models:make_model: RuntimeError",
        ),
        (dict(loss=None), "needs loss="),
        (dict(dataset=None), "needs dataset="),
        (dict(strategy="tp"), "TwoLayerNet has no parallel_plan"),
        (dict(strategy="pipeline"), "TwoLayerNet has no parallel_plan"),
        (dict(activation_checkpointing=True), "activation_checkpointing needs"),
    ],
)
def test_bad_input_is_one_line_before_engines(change, message):
    cfg = nbpar.TrainConfig(**{**USER, "strategy": "ddp", "micro_batch": 16, **change})
    with pytest.raises(ValueError, match=message) as err:
        cfg.validate(2)
        check_model(cfg, 2)
    assert "\n" not in str(err.value)


def test_a_model_larger_than_the_machine_is_refused():
    cfg = nbpar.TrainConfig(**USER, strategy="zero3").validate(2)
    check_fits(cfg, 10_000, 2, machine_bytes=10**9)  # 10k parameters fit in 1 GB
    with pytest.raises(ValueError, match=r"needs about .* more than this machine's 1.0 GB"):
        check_fits(cfg, 10**9, 2, machine_bytes=10**9)


def test_on_a_gpu_pool_each_rank_must_fit_one_gpu_not_the_hosts_memory():
    """On GPUs a rank's states live in its device: 1e9 parameters under DDP (16 GB a
    rank) fit a host with 2 TB but not an 8 GB GPU; ZeRO-3 over 8 ranks fits that GPU;
    what CPU offload puts on the host is checked against the host, all ranks together."""
    big = dict(machine_bytes=2 * 10**12, pg_backend="nccl")
    ddp = nbpar.TrainConfig(**USER, strategy="ddp").validate(8, pg_backend="gloo")
    check_fits(ddp, 10**9, 8, machine_bytes=2 * 10**12)  # a CPU pool: the host holds it
    with pytest.raises(ValueError, match=r"per GPU .* more than one GPU's 8.0 GB"):
        check_fits(ddp, 10**9, 8, **big, device_bytes=8 * 10**9)
    check_fits(ddp, 10**9, 8, **big, device_bytes=80 * 10**9)
    check_fits(ddp, 10**9, 8, **big, device_bytes=None)  # no GPU seen here: not checked
    zero3 = nbpar.TrainConfig(**USER, strategy="zero3").validate(8, pg_backend="gloo")
    check_fits(zero3, 10**9, 8, **big, device_bytes=8 * 10**9)
    offload = nbpar.TrainConfig(
        **USER, strategy="zero3", backend="deepspeed", offload="optimizer"
    ).validate(8, pg_backend="gloo")
    with pytest.raises(ValueError, match=r"offloaded to the host by 8 rank\(s\)"):
        check_fits(offload, 10**9, 8, machine_bytes=10**9, pg_backend="nccl", device_bytes=None)


def test_pool_train_refuses_before_the_engines_start(pool):
    with pytest.raises(ValueError, match="does not fit model"):
        pool.train(nbpar.TrainConfig(**{**USER, "dataset": M + "wrong_shape_data"}))
    assert all(s["state"] != "busy" for s in pool.status())


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "nbpar", "train", *args], capture_output=True, text=True, timeout=600
    )


FLAGS = ("--model", M + "make_model", "--dataset", M + "make_data", "--loss", M + "mse")


def test_cli_trains_the_users_module_like_the_reference():
    import json

    from nbpar.train.loop import run_training

    out = _cli(
        *FLAGS,
        "--model-config",
        '{"width": 16}',
        "--strategy",
        "zero2",
        "--micro-batch",
        "8",
        "--steps",
        "10",
        "--lr",
        "0.01",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["config"]["model_config"] == {"width": 16}
    ref = run_training(
        nbpar.TrainConfig(
            **USER, model_config={"width": 16}, strategy="single", micro_batch=16, steps=10, lr=1e-2
        )
    )
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--model", M + "raises"), "raised RuntimeError: weights file missing"),
        (("--dataset", M + "wrong_shape_data"), "does not fit model"),
        (("--model-config", "{width: 3}"), "--model-config is not JSON"),
        (("--strategy", "tp"), "has no parallel_plan"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(args, message):
    flags = dict(zip(FLAGS[::2], FLAGS[1::2]))
    flags.update(dict(zip(args[::2], args[1::2])))
    out = _cli(*[x for kv in flags.items() for x in kv], "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_picker_offers_and_trains_a_registered_model(pool):
    """The widgets list every registered model and train it on the engines, equal to
    `pool.train` with the same settings."""
    from nbpar.view.widgets import StrategyPicker

    nbpar.register_model("picked_net", M + "make_model", dataset=M + "make_data", loss=M + "mse")
    picker = StrategyPicker(pool, background=False)
    options = [value for _, value in picker.fields["model"].options]
    assert options[:5] == ["simple_cnn", "tiny_gpt", "tiny_moe", "hf:gpt2", "hf:llama"]
    assert "picked_net" in options
    picker.fields["model"].value = "picked_net"
    picker.fields["strategy"].value = "zero3"
    picker.fields["steps"].value = "6"
    assert picker.problems == []
    run = picker._launch()
    assert run is not None and run.cfg.model == "picked_net"
    got = torch.tensor(run.result()["losses"])
    cfg = nbpar.TrainConfig(
        model="picked_net",
        strategy="single",
        steps=6,
        seed=0,
        micro_batch=2 * run.cfg.micro_batch,
        lr=run.cfg.lr,
    )
    ref = torch.tensor(pool.train(cfg).result()["losses"])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


NOTEBOOK_CELL = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

WIDTH = 16

def make_model():
    return nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1), nn.Flatten(0))

def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, x.sum(1))

def mse(out, target):
    return F.mse_loss(out, target)
"""


def test_functions_defined_in_a_notebook_reach_the_engines(pool):
    """Functions of ``__main__`` (a notebook's cells) travel by value, with the globals
    they use; registered ones too."""
    cell = {"__name__": "__main__"}
    exec(NOTEBOOK_CELL, cell)
    mine = dict(model=cell["make_model"], dataset=cell["make_data"], loss=cell["mse"])
    ref = _losses(pool, strategy="single", micro_batch=16, **mine)
    torch.testing.assert_close(
        _losses(pool, strategy="ddp", micro_batch=8, **mine), ref, atol=1e-5, rtol=0
    )
    nbpar.register_model("cell_net", mine["model"], dataset=mine["dataset"], loss=mine["loss"])
    torch.testing.assert_close(
        _losses(pool, strategy="zero3", micro_batch=8, model="cell_net"), ref, atol=1e-5, rtol=0
    )


def test_a_factory_model_checkpoints_and_resumes(pool, tmp_path):
    """A callable factory is written as its "module:name"; resuming continues the curve."""
    kw = dict(
        model=user_models.make_model,
        dataset=user_models.make_data,
        loss=user_models.mse,
        strategy="zero2",
        micro_batch=8,
    )
    whole = _losses(pool, **kw)
    first = nbpar.TrainConfig(
        steps=10, seed=SEED, lr=1e-2, checkpoint_dir=str(tmp_path), checkpoint_every=10, **kw
    )
    pool.train(first).result()
    rest = _losses(pool, resume_from=str(tmp_path), **kw)
    torch.testing.assert_close(rest, whole[10:], atol=1e-5, rtol=0)
