"""Data parallelism with DistributedDataParallel (Li et al., VLDB 2020).

Every dp rank holds the whole model; gradients are averaged by bucketed
all-reduces that overlap with backward. With gradient accumulation only the
last micro-batch synchronises: the others run under ``no_sync()``, so a step
costs one all-reduce round however many micro-batches it has.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from nbpar.measure.metrics import CommTimer, HookState, timed_allreduce_hook
from nbpar.model.models import loss_fn
from nbpar.parallel.common import autocast_dtype, make_optimizer, model_device_type
from nbpar.parallel.runner import StepRunner


def apply_ddp(model, dp_mesh, *, timer: CommTimer | None = None) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over the 1-D ``dp_mesh`` (e.g. ``mesh["dp"]``).

    Rank 0 of the dp group broadcasts its weights at construction. With a
    ``timer``, every bucket's all-reduce is timed by a comm hook that calls
    the default all-reduce hook (same numerics).
    """
    device_ids = (
        None if model_device_type(model) == "cpu" else [next(model.parameters()).device.index]
    )
    ddp = DistributedDataParallel(model, device_ids=device_ids, device_mesh=dp_mesh)
    if timer is not None:
        ddp.register_comm_hook(HookState(dp_mesh.get_group(), timer), timed_allreduce_hook)
    return ddp


class DDPRunner(StepRunner):
    """StepRunner whose micro-batches skip the all-reduce except the last one."""

    def __init__(self, model, optimizer, loss, *, timer: CommTimer, **kw):
        super().__init__(model, optimizer, loss, **kw)
        self.comm_timer = timer

    def train_step(self, micro_batches):
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            sync = self.model.no_sync() if i < n - 1 else contextlib.nullcontext()
            with sync:
                losses.append(self.forward_backward(x, y, 1.0 / n))
        self.optimizer_step()
        return torch.stack(losses).mean()

    def close(self) -> None:
        self.model = None
        super().close()


def build_runner(model, cfg, mesh) -> DDPRunner:
    """DDP over ``mesh["dp"]`` with the optimizer and precision of ``cfg``."""
    timer = CommTimer()
    ddp = apply_ddp(model, mesh["dp"], timer=timer)
    return DDPRunner(
        ddp,
        make_optimizer(ddp.parameters(), cfg),
        loss_fn(cfg),
        timer=timer,
        autocast_dtype=autocast_dtype(cfg),
        device_type=model_device_type(model),
    )
