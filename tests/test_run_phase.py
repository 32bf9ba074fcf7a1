"""Before a run's first step its "starting..." line says what the ranks are doing (the
issue: 7.6 s of a bare "starting..." while DeepSpeed builds its engine)."""

from __future__ import annotations

import time

import pytest

import nbpar
from nbpar.config import TrainConfig
from nbpar.train.loop import run_training, wrap_phase
from nbpar.view.dashboard import Dashboard
from tests.viz_fakes import FakeRun

pytestmark = pytest.mark.timeout(240)

IMPORTS = "the ranks are importing the training code"
SETUP = [
    "building the device mesh",
    "building the model tiny_gpt",
    "wrapping the model for single",
    "loading the data",
    "the first step (its one-off set-up included)",
]


def test_every_set_up_stage_is_said_in_order_before_the_first_step():
    said, steps = [], []

    def publish(record):
        steps.append((len(said), record["step"]))

    run_training(
        TrainConfig(model="tiny_gpt", strategy="single", steps=2),
        publish=publish,
        phase=said.append,
    )
    assert said == SETUP
    assert steps[0] == (len(SETUP), 0)  # the first step came after the last stage was said


def test_deepspeed_says_it_builds_its_engine():
    assert wrap_phase(TrainConfig(strategy="zero2", backend="deepspeed")) == (
        "importing DeepSpeed and building its engine"
    )
    assert wrap_phase(TrainConfig(strategy="zero2")) == "wrapping the model for zero2"


def test_the_dashboard_shows_the_stage_until_the_first_step():
    class Starting(FakeRun):
        phase = "importing DeepSpeed and building its engine, 3 s"

    dash = Dashboard(Starting())
    assert dash.progress()["text"] == (
        "starting… importing DeepSpeed and building its engine, 3 s · 0/20 steps"
    )
    assert Dashboard(FakeRun()).progress()["text"] == "starting… 0/20 steps"  # none said


def test_a_real_run_says_its_stage_then_nothing_once_it_steps(pool):
    run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", steps=4))
    dash = Dashboard(run)
    seen, texts = set(), set()
    while not run.history and not run.done():
        if run.phase is not None:
            seen.add(run.phase.rsplit(",", 1)[0])
            texts.add(dash.progress()["text"])
        time.sleep(0.01)
    run.wait()
    assert seen and seen <= {
        *SETUP[:2],
        "wrapping the model for ddp",
        *SETUP[3:],
        IMPORTS,
    }
    assert any(t.startswith("starting… ") and t.endswith(" s · 0/4 steps") for t in texts), texts
    assert run.phase is None  # once a step is published
