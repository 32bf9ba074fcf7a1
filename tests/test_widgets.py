"""StrategyPicker: invalid choices are explained and block the Run button; Run trains the
widgets' config on the pool and shows its dashboard."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nbpar.config import GPTConfig
from nbpar.view.dashboard import Dashboard
from nbpar.view.widgets import StrategyPicker
from tests.viz_fakes import FakeRun, history


@dataclass
class FakePool:
    n: int = 2
    trained: list = field(default_factory=list)

    def train(self, cfg):
        self.trained.append(cfg)
        return FakeRun(cfg=cfg, ranks=list(range(self.n)),
                       history=history(cfg.steps, ranks=tuple(range(self.n)),
                                       comm=(0.01,) * self.n),
                       finished=True)


def _set(picker, **values):
    for name, value in values.items():
        picker.fields[name].value = value


def test_defaults_are_valid_and_show_the_global_batch():
    picker = StrategyPicker(FakePool(2), background=False)
    assert picker.check() is None and picker.button.disabled is False
    assert picker.message == "ready: ddp/torch on 2 rank(s), dp=2 tp=1 pp=1"
    _set(picker, micro_batch=4, grad_accum=3)
    assert picker.batch_label.value == "global batch = micro x accum x dp = 4 x 3 x 2 = 24"
    _set(picker, strategy="pipeline")
    assert picker.batch_label.value.endswith("4 x 3 x 1 = 12")


@pytest.mark.parametrize("values, reason", [
    ({"strategy": "hybrid", "dp": 4, "tp": 2}, r"dp\*tp\*pp = 4\*2\*1 = 8"),
    ({"offload": "optimizer"}, "needs backend='deepspeed'"),
    ({"strategy": "tp"}, "tp=4 must divide gpt.n_heads=6"),
    ({"strategy": "tp", "model": "simple_cnn"}, "needs model 'tiny_gpt'"),
    ({"precision": "fp16"}, "fp16"),
])
def test_invalid_combinations_are_explained_before_launch(values, reason):
    import re

    pool = FakePool(4)
    picker = StrategyPicker(pool, background=False, gpt=GPTConfig(d_model=24, n_heads=6))
    _set(picker, **values)
    assert picker.button.disabled is True
    assert picker.message.startswith("cannot run: ")
    assert re.search(reason, picker.message), picker.message
    picker._launch()  # a click on a disabled button does nothing
    assert pool.trained == []


def test_fixing_the_choice_enables_run_again():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, strategy="hybrid", dp=2, tp=2)
    assert picker.button.disabled
    assert picker.batch_label.value.endswith("? (degrees do not fit the pool)")
    _set(picker, tp=1)
    assert not picker.button.disabled
    assert picker.config().dims(2).dp == 2


def test_run_button_trains_the_widgets_config_and_shows_a_dashboard():
    pool = FakePool(2)
    picker = StrategyPicker(pool, background=False)
    _set(picker, strategy="zero1", backend="deepspeed", micro_batch=4, grad_accum=2,
         steps=5, precision="bf16", offload="optimizer")
    picker.button.click()
    assert len(pool.trained) == 1
    cfg = pool.trained[0]
    assert (cfg.strategy, cfg.backend, cfg.micro_batch, cfg.grad_accum, cfg.steps,
            cfg.precision, cfg.offload) == ("zero1", "deepspeed", 4, 2, 5, "bf16",
                                            "optimizer")
    assert cfg == picker.config()
    assert picker.run is not None and picker.run.cfg is cfg
    assert isinstance(picker.dashboard, Dashboard)
    assert picker.dashboard.text == "done: 5/5 steps · 0.1 s/step"
    assert len(picker.dashboard.figure.axes[0].get_lines()) == 2


def test_single_runs_on_one_rank_and_train_errors_are_shown():
    class Closed(FakePool):
        def train(self, cfg):
            raise RuntimeError("the pool is shut down")

    picker = StrategyPicker(Closed(2), background=False)
    _set(picker, strategy="single")
    assert picker.message == "ready: single/torch on 1 rank(s), dp=1 tp=1 pp=1"
    picker.button.click()
    assert picker.message == "could not start: the pool is shut down"
    assert picker.run is None and picker.button.disabled is False
