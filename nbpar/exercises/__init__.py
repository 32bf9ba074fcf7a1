"""Exercises checked on the pool: the learner writes the parallel code, a checker runs
it on every rank and answers with a pass or the one hint that matters.

In a ``%%dist`` cell, define the function the exercise asks for and hand it to
`check` on every rank::

    %%dist
    def ring_all_reduce(t):
        ...
    nbpar.exercises.check("ring_all_reduce", ring_all_reduce)

Rank 0 prints ``ring all-reduce: passed: ...`` or ``... not yet: rank 1 sent 96 B
where a ring sends ...``; every rank gets the same `Verdict` back (truthy when passed),
so a solution cell can ``assert`` it. `EXERCISES` lists them.
"""

from __future__ import annotations

from nbpar.exercises.verdict import Verdict

#: name -> (module, checker, what the function must do)
EXERCISES = {
    "ring_all_reduce": (
        "collectives",
        "check_ring_all_reduce",
        "fn(t) -> t summed over ranks, from send/recv only",
    ),
    "all_reduce_from_halves": (
        "collectives",
        "check_all_reduce_from_halves",
        "fn(t) -> t summed over ranks, from one reduce_scatter and one all_gather",
    ),
    "shard_indices": (
        "data",
        "check_shard_indices",
        "fn(n, rank, world, epoch, seed) -> the indices DistributedSampler gives rank",
    ),
    "average_gradients": (
        "ddp",
        "check_average_gradients",
        "fn(model) after backward -> every .grad the mean over ranks, as DDP's",
    ),
    "accumulate": (
        "ddp",
        "check_accumulate",
        "fn(ddp_model, micro_batches) -> one step's gradients, DDP syncing once (no_sync)",
    ),
    "tp_mlp": (
        "tensor",
        "check_tp_mlp",
        "fn(x, w1_shard, w2_shard) -> the MLP's output: column- then row-parallel linear",
    ),
    "mesh": (
        "tensor",
        "check_mesh",
        "fn(dp, tp) -> a DeviceMesh of shape (dp, tp) named ('dp', 'tp')",
    ),
    "zero1_step": (
        "zero",
        "check_zero1_step",
        "fn(flat_params, flat_grad, lr) -> (params, optimizer): Adam on this rank's slice",
    ),
    "fully_shard": (
        "zero",
        "check_fully_shard",
        "fn(model) -> model with fully_shard on each Linear, then on the model",
    ),
    "gpipe": (
        "pipeline",
        "check_gpipe",
        "fn(stage, rank, data, group): two stages, all forwards then all backwards",
    ),
    "memory": (
        "sizing",
        "check_memory",
        "fn(n_params, world, stage) -> bytes a rank holds: params, grads, optim (bf16 Adam)",
    ),
    "training_time": (
        "sizing",
        "check_training_time",
        "fn(n_params, tokens, gpus, peak_flops, mfu) -> seconds (6 N D FLOPs)",
    ),
}
#: exercises that run on one process, no pool needed
LOCAL = {"memory", "training_time"}


def check(name: str, fn, **options) -> Verdict:
    """Check ``fn`` for exercise ``name`` on every rank (call it on all of them; the
    sizing exercises, `LOCAL`, in the notebook's own process)."""
    import importlib

    if name not in EXERCISES:
        raise ValueError(f"no exercise {name!r}; there are: {', '.join(EXERCISES)}")
    if not callable(fn):
        raise ValueError(f"check({name!r}, fn): fn must be your function, got {fn!r}")
    import torch.distributed as dist

    if name not in LOCAL and not dist.is_initialized():
        raise RuntimeError("exercises run on the pool's ranks: check them in a %%dist cell")
    module, checker, _ = EXERCISES[name]
    return getattr(importlib.import_module(f"nbpar.exercises.{module}"), checker)(fn, **options)


__all__ = ["EXERCISES", "Verdict", "check"]
