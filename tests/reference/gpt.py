"""The tiny GPT the pipeline, hybrid and tensor-parallel tests train: sizes, model, the
micro-batches of each global step (the same on every rank) and the single-process
reference run."""

from __future__ import annotations

import functools

import torch

from nbpar.config import GPTConfig, TrainConfig
from nbpar.model.models import TinyGPT
from nbpar.model.models import next_token_loss as lm_loss

STEPS, ACCUM, MICRO = 20, 4, 2


SIZES = dict(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=4)


def make_model(seed=0, **sizes):
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(**{**SIZES, **sizes}))


def make_cfg(**kw):
    base = dict(
        model="tiny_gpt",
        schedule="1f1b",
        grad_accum=ACCUM,
        micro_batch=MICRO,
        lr=1e-3,
        optimizer="adam",
        precision="fp32",
        strategy="pipeline",
        gpt=GPTConfig(**SIZES),
    )
    return TrainConfig(**{**base, **kw})


def batches(step, accum=ACCUM, micro=MICRO):
    """The micro-batches (x, y) of global step ``step``; same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0, SIZES["vocab_size"], (accum * micro, SIZES["seq_len"] + 1), generator=g
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    return [(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) for i in range(accum)]


def reference_run(steps=STEPS, accum=ACCUM, micro=MICRO, autocast_dtype=None, **sizes):
    """Reference: full model, one process, Adam (lr 1e-3) with accumulation over the same
    micro-batches; (loss per step, the final state dict)."""
    from nbpar.parallel.runner import StepRunner

    model = make_model(**sizes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    runner = StepRunner(model, optimizer, lm_loss, autocast_dtype=autocast_dtype)
    losses = [runner.train_step(batches(s, accum, micro)).item() for s in range(steps)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def single_losses(steps=STEPS, accum=ACCUM, micro=MICRO):
    """The reference run's losses (computed once per session)."""
    return reference_run(steps, accum, micro)[0]


def build_mesh(world, **dims):
    from nbpar.dims import ParallelDims

    return ParallelDims(world_size=world, **dims).build_mesh("cpu")
