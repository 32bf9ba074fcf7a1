"""Torch-native ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020) over the dp dimension.

- zero1: DDP + ``ZeroRedundancyOptimizer``: each dp rank keeps the Adam state of
  about 1/N of the parameters (stage 1, P_os); params and grads stay whole.
- zero2: FSDP2 ``fully_shard(reshard_after_forward=False)``: grads and optimizer
  state sharded; parameters stay gathered from forward to backward (stage 2-like).
- zero3: FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters sharded at
  rest too, gathered per block just in time (stage 3, P_os+g+p).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from nbpar.measure.holdings import optimizer_state_tensors, tensor_bytes
from nbpar.parallel.ddp import DDPRunner
from nbpar.parallel.runner import StepRunner
from nbpar.strategies import reshard_after_forward


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the model's declared plan
    (`nbpar.model.plan`), else a ``layers`` container, else none (one unit, the root)."""
    from nbpar.model.plan import plan_of

    plan = plan_of(model)
    if plan is not None:
        return list(plan.layers.values())
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    return []


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    reshard_after_forward: bool = True,
    *,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the 1-D ``dp_mesh`` (e.g. ``mesh["dp"]``), in place.

    Each block becomes its own FSDP unit (one all-gather per block in forward,
    one reduce-scatter per block in backward), then the root takes the rest
    (embeddings, norm, head). ``param_dtype`` (e.g. ``torch.bfloat16``) computes
    in that dtype while gradients are reduced and stored in fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def policy(root: bool) -> MixedPrecisionPolicy:
        if param_dtype is None:
            return MixedPrecisionPolicy()
        # the root hands fp32 logits to the loss
        return MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32 if root else None,
        )

    for block in model_blocks(model):
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy(False),
        )
    fully_shard(
        model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy(True)
    )
    return model


def apply_zero1(
    model: nn.Module, dp_mesh, optimizer_class=torch.optim.Adam, *, timer=None, **defaults
):
    """DDP over ``dp_mesh`` plus a ZeroRedundancyOptimizer over the same group.

    Returns ``(ddp_model, optimizer)``; ``defaults`` go to ``optimizer_class``
    (e.g. ``lr=1e-3``). Parameters are assigned to ranks whole, greedily by
    size, so the state split is ~1/N when the model has many similar tensors.
    """
    from nbpar.parallel.ddp import apply_ddp

    ddp = apply_ddp(model, dp_mesh, timer=timer)
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=optimizer_class,
        process_group=dp_mesh.get_group(),
        **defaults,
    )
    return ddp, opt


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, as fp32 copies keyed by the unwrapped name
    (FSDP2's DTensors are all-gathered: a collective, call it on every dp rank)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = t.detach().float().clone()
    return out


class Zero1Runner(DDPRunner):
    """DDP + sharded optimizer (ZeRO-1); accumulation skips the all-reduce until the last
    micro-batch, and ``optimizer.step()`` updates this rank's partition, then broadcasts it."""

    def memory(self) -> dict[str, int]:
        out = super().memory()
        # the state lives in the wrapped local optimizer, over this rank's partition only
        out["optim_bytes"] = tensor_bytes(optimizer_state_tensors(self.optimizer.optim))
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters(self.model)

    def close(self) -> None:
        self.model = None
        super().close()


class FSDPRunner(StepRunner):
    """FSDP2 runner; gradient accumulation reduce-scatters only on the last micro-batch.

    Earlier micro-batches keep unsharded fp32 gradients locally (``set_requires_
    gradient_sync(False)``): one reduce-scatter per step instead of one per
    micro-batch, at the cost of full-size gradients during accumulation.
    """

    def train_step(self, micro_batches):
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == n - 1)
            losses.append(self.forward_backward(x, y, 1.0 / n))
        self.optimizer_step()
        return torch.stack(losses).mean()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters(self.model)

    def close(self) -> None:
        self.model = None
        super().close()


def build_runner(model, cfg, mesh, loss=None) -> StepRunner:
    """The runner of torch ZeRO ``cfg.strategy`` over ``mesh["dp"]``.

    ``loss`` defaults to ``nbpar.model.models.loss_fn(cfg)``.
    """
    from nbpar.parallel.common import (
        autocast_dtype,
        make_optimizer,
        model_device_type,
        optimizer_spec,
    )

    if loss is None:
        from nbpar.model.models import loss_fn

        loss = loss_fn(cfg)
    device_type = model_device_type(model)
    dp_mesh = mesh["dp"]
    if cfg.strategy == "zero1":
        from nbpar.measure.metrics import CommTimer

        timer = CommTimer()
        cls, kwargs = optimizer_spec(cfg)
        ddp, opt = apply_zero1(model, dp_mesh, cls, timer=timer, **kwargs)
        return Zero1Runner(
            ddp, opt, loss, timer=timer, autocast_dtype=autocast_dtype(cfg), device_type=device_type
        )
    apply_fsdp(
        model,
        dp_mesh,
        reshard_after_forward(cfg.strategy, cfg.fsdp_reshard),
        param_dtype=autocast_dtype(cfg),
    )
    return FSDPRunner(model, make_optimizer(model.parameters(), cfg), loss, device_type=device_type)
