"""The one interface every strategy implements: a step runner on one rank.

`train.py` drives any strategy through it: hand it the micro-batches of one
optimizer step, get back this rank's mean loss; ask it what memory it holds.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from nbpar.measure.holdings import optimizer_state_tensors, tensor_bytes
from nbpar.measure.records import ModelStates


def clip_grad_norm(params, max_norm: float, pp_group=None) -> float:
    """Scale gradients so their global 2-norm is at most ``max_norm``; returns the norm.

    Sharded (DTensor) gradients are reduced over their mesh, pipeline stages over
    ``pp_group`` (torchtitan's recipe), so every rank scales by the same factor; plain
    gradients next to DTensor ones (tensor parallelism leaves embeddings whole) are
    normed apart, since torch will not mix the two in one norm.
    """
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    squares = torch.zeros((), dtype=torch.float32)
    if sharded:
        squares = squares + torch.nn.utils.get_total_norm(sharded, 2.0).full_tensor().cpu() ** 2
    if plain:
        squares = squares + torch.nn.utils.get_total_norm(plain, 2.0).float().cpu() ** 2
    if pp_group is not None:
        device = grads[0].device if grads else torch.device("cpu")
        squares = squares.to(device)
        dist.all_reduce(squares, group=pp_group)
    norm = float(squares) ** 0.5
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


class StepRunner:
    """Owns the (wrapped) model and optimizer of one strategy on one rank.

    The base class is plain single-process training with gradient
    accumulation; strategies override what differs (DDP's ``no_sync``,
    DeepSpeed's engine, pipeline schedules).
    """

    def __init__(
        self, model: nn.Module, optimizer, loss_fn, *, autocast_dtype=None, device_type: str = "cpu"
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def forward_backward(self, x, y, scale: float) -> torch.Tensor:
        with self.autocast():
            loss = self.loss_fn(self.model(x), y)
        (loss * scale).backward()
        return loss.detach().float()

    def train_step(self, micro_batches) -> torch.Tensor:
        """Accumulate gradients over ``micro_batches``, then one optimizer step.

        Returns this rank's mean loss over its micro-batches (0-dim tensor).
        """
        self.optimizer.zero_grad(set_to_none=True)
        scale = 1.0 / len(micro_batches)
        losses = [self.forward_backward(x, y, scale) for x, y in micro_batches]
        self.optimizer_step()
        return torch.stack(losses).mean()

    # ---- the update rule every torch strategy shares: clip, schedule, step
    max_grad_norm: float = 0.0
    lr_schedule = None
    steps_taken: int = 0
    norm_group = None

    def set_update_rule(self, cfg, pp_group=None) -> None:
        """Clip to ``cfg.grad_clip`` and follow ``cfg.lr_schedule`` (DeepSpeed's
        semantics, `nbpar.model.lr_schedule`); ``pp_group`` joins the gradient norm of
        pipeline stages, which each hold some of the parameters."""
        from nbpar.model.lr_schedule import Schedule, resolve

        self.max_grad_norm = float(cfg.grad_clip)
        self.norm_group = pp_group
        if cfg.lr_schedule:
            self.lr_schedule = Schedule(resolve(cfg.lr_schedule, cfg.lr, cfg.steps), cfg.lr)

    def optimizer_step(self) -> None:
        """One optimizer step: clip the global gradient norm, set the scheduled lr
        (and OneCycle's betas) for this step, step."""
        if self.max_grad_norm > 0:
            clip_grad_norm(self.parameters(), self.max_grad_norm, self.norm_group)
        if self.lr_schedule is not None:
            it = self.steps_taken - 1  # step k runs with the value after k scheduler steps
            lr, betas = self.lr_schedule.lr(it), self.lr_schedule.betas(it)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
                if betas is not None and "betas" in group:
                    group["betas"] = betas
        self.optimizer.step()
        self.steps_taken += 1

    def parameters(self):
        return list(self.model.parameters())

    def memory(self) -> ModelStates:
        """Parameter, gradient and optimizer-state bytes this rank holds."""
        params = self.parameters()
        return {
            "param_bytes": tensor_bytes(params),
            "grad_bytes": tensor_bytes(p.grad for p in params),
            "optim_bytes": tensor_bytes(optimizer_state_tensors(self.optimizer)),
        }

    def close(self) -> None:
        """Release what the strategy built (engines, groups); idempotent."""
        self.optimizer = None
