"""Memory a step really holds (nbpar.measure.memtrack): exact on a model small enough to
count by hand, and per run on the engines, so a strategy with half the model states
reports a lower peak than the run before it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbpar
from nbpar.measure.memtrack import StepMemory
from nbpar.parallel.runner import StepRunner


def test_activations_and_peak_counted_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 500), nn.Linear(500, 10))
    runner = StepRunner(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: out.sum()
    )
    x = torch.randn(64, 1000)
    with StepMemory(runner) as mem:
        runner.train_step([(x, None)])
    fig = mem.figures()
    # saved for backward: the first Linear's input (64 x 1000) and the second's
    # (64 x 500); the weights it also saves are parameters, not activations
    assert fig["activation_bytes"] == 64 * 1000 * 4 + 64 * 500 * 4
    params = sum(p.numel() * 4 for p in model.parameters())
    # at least parameters + activations + the gradients being built; never more than
    # that plus a few temporaries of the same sizes
    assert params + fig["activation_bytes"] < fig["tracked_peak_bytes"] < 3 * params
    assert mem.live >= params  # what is freed is subtracted: params + grads remain


def test_a_meter_that_cannot_follow_says_so_and_never_breaks_the_step():
    class Odd:
        optimizer = None

        def parameters(self):
            raise RuntimeError("no parameters here")

    mem = StepMemory(Odd())
    with mem:
        torch.ones(3) * 2
    assert mem.figures() == {"memory_error": "RuntimeError: no parameters here"}


@pytest.mark.timeout(300)
def test_peaks_are_per_run_and_follow_the_model_states(pool):
    gpt = nbpar.GPTConfig(d_model=128, n_layers=4)

    def run(strategy):
        res = pool.train(
            nbpar.TrainConfig(strategy=strategy, gpt=gpt, micro_batch=4, steps=3)
        ).result()
        return res["ranks"][0]

    ddp, zero3, ddp_again = run("ddp"), run("zero3"), run("ddp")
    states = {
        k: r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        for k, r in (("ddp", ddp), ("zero3", zero3))
    }
    assert states["zero3"] == pytest.approx(states["ddp"] / 2, rel=0.01)
    assert zero3["peak_bytes"] < ddp["peak_bytes"]  # not the process's lifetime maximum
    assert ddp_again["peak_bytes"] == pytest.approx(ddp["peak_bytes"], rel=0.01)
    for r in (ddp, zero3, ddp_again):
        assert r["peak_bytes"] > states["ddp" if r is not zero3 else "zero3"]
        assert 0 < r["activation_bytes"] < r["peak_bytes"]
        assert r["process_peak_bytes"] > r["peak_bytes"]  # the process, apart
