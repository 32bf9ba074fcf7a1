"""One pipeline rank's step on fake tensors, in its schedule's order.

The stage is cut exactly as a real run cuts it (`nbpar.parallel.pipeline_cut.split_stages`),
then split Megatron-style over tp (`apply_tp`) and, when ``fsdp_reshard`` is set, sharded
with FSDP2 over dp, as `nbpar.parallel.hybrid` prepares a stage. torch's schedule objects
agree on shapes through object collectives a fake group cannot answer, so the step walks
the schedule itself: GPipe runs every forward, then every backward (Huang et al. 2019);
1F1B lets stage i run p - i - 1 forwards ahead, then alternates (PipeDream-Flush,
Narayanan et al. 2019), so stage i holds at most p - i micro-batches. Boundaries are real
``dist.send``/``dist.recv`` calls on the fake group, one activation forward and one
gradient back per micro-batch, so the communication meter counts them. `segments_step`
runs two micro-batches and leaves the rest to `nbpar.simulate.segments.compose`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nbpar.parallel.hybrid import HybridRunner, _apply_fsdp
from nbpar.parallel.pipeline_cut import split_stages
from nbpar.parallel.runner import StepRunner
from nbpar.strategies import reshard_after_forward


def schedule_order(schedule: str, stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    """[("F"|"B", micro-batch)] in the order stage ``stage`` of ``pp`` runs ``m`` of them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


class StageStep(StepRunner):
    """The step of one pipeline rank; ``model`` is its stage module."""

    reduce_data_parallel_grads = HybridRunner.reduce_data_parallel_grads
    grad_sync = None  # expert parallelism's average (`build_stage_runner` sets it)

    def __init__(
        self,
        *args,
        stage: int,
        pp: int,
        schedule: str,
        rank: int,
        stride: int,
        pp_group,
        dp_group=None,
        fsdp: bool = False,
        sequence_shards: int = 1,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.sequence_shards = sequence_shards  # tp under sequence parallelism
        self.stage, self.pp, self.schedule, self.pp_group = stage, pp, schedule, pp_group
        self.prev, self.next = rank - stride, rank + stride  # neighbours' global ranks
        self.dp_group, self.fsdp = dp_group, fsdp

    def _forward(self, x, y, scale):
        first, last = self.stage == 0, self.stage == self.pp - 1
        if not first:
            dist.recv(x, src=self.prev, group=self.pp_group)
            x.requires_grad_(True)
        with self.autocast():
            out = self.model(x)
        if last:
            return x, self.loss_fn(out, y) * scale
        dist.send(out.detach(), dst=self.next, group=self.pp_group)
        return x, out

    def _backward(self, x, out, sync: bool):
        if self.fsdp:
            self.model.set_requires_gradient_sync(sync)
        if self.stage == self.pp - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=self.next, group=self.pp_group)
            out.backward(grad)
        if self.stage > 0:
            dist.send(x.grad, dst=self.prev, group=self.pp_group)

    def train_step(self, micro_batches):
        self.optimizer.zero_grad(set_to_none=True)
        m, held, losses = len(micro_batches), {}, []
        for kind, i in schedule_order(self.schedule, self.stage, self.pp, m):
            if kind == "F":
                self._forward_micro_batch(micro_batches, i, held, losses)
            else:
                self._backward(*held.pop(i), sync=i == m - 1)
        self.reduce_data_parallel_grads()
        self.optimizer_step()
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def segments_step(self, micro_batches, meter) -> None:
        """The step metered as segments on ``meter`` (`nbpar.simulate.segments`): its
        start, the forward and backward of micro-batches 0 and 1, its end; the other
        micro-batches repeat micro-batch 1 and are left to `segments.compose`."""
        m, held, losses = len(micro_batches), {}, []
        with meter.measure("head"):
            self.optimizer.zero_grad(set_to_none=True)
        for i in range(min(m, 2)):
            with meter.measure(("F", i)):
                self._forward_micro_batch(micro_batches, i, held, losses)
        for i in range(min(m, 2)):
            with meter.measure(("B", i)):
                self._backward(*held.pop(i), sync=i == m - 1)
        with meter.measure("tail"):
            self.reduce_data_parallel_grads()
            self.optimizer_step()

    def _forward_micro_batch(self, micro_batches, i: int, held: dict, losses: list) -> None:
        """Micro-batch ``i``'s forward; what backward needs is kept in ``held``."""
        m = len(micro_batches)
        x, y = micro_batches[i]
        held[i] = self._forward(self._input(x), y, 1.0 / m)
        if self.stage == self.pp - 1:
            losses.append(held[i][1].detach() * m)

    def _input(self, tokens):
        """Stage 0 takes the batch; later stages a hidden-state buffer (b, s, d), d the
        input width of the stage's first linear layer (a block's attention input); with
        sequence parallelism (b, s/tp, d), this rank's tokens. The buffer has the
        parameters' dtype: under autocast the residual stream stays fp32 (the embeddings
        are not autocast and each residual add promotes), as torch's pipeline infers from
        the first stage's output."""
        if self.stage == 0:
            return tokens
        d = next(m for m in self.model.modules() if isinstance(m, nn.Linear)).in_features
        b, s = tokens.shape
        dtype = next(self.model.parameters()).dtype
        return torch.empty(b, s // self.sequence_shards, d, dtype=dtype)


def build_stage_runner(model: nn.Module, cfg, mesh, rank: int) -> StageStep:
    """The stage of ``rank``: cut, tp-split, dp-sharded as a real hybrid run does."""
    from nbpar.model.models import loss_fn
    from nbpar.parallel.common import autocast_dtype, make_optimizer
    from nbpar.parallel.hybrid import expert_sync
    from nbpar.parallel.tensor import apply_tp

    pp, dp, tp = mesh["pp"].size(), mesh["dp"].size(), mesh["tp"].size()
    stage = mesh["pp"].get_local_rank()
    (chunk,) = split_stages(model, stage, pp, in_place=True)
    if tp > 1:
        apply_tp(chunk, mesh["tp"], cfg.sequence_parallel)
    experts = expert_sync(cfg, mesh)
    if experts is not None:
        experts.apply(chunk)
    reshard = reshard_after_forward(cfg.strategy, cfg.fsdp_reshard)
    if dp > 1 and reshard is not None:
        _apply_fsdp(chunk, mesh["dp"], reshard)
    dp_group = mesh["dp"].get_group() if dp > 1 and reshard is None else None
    runner = StageStep(
        chunk,
        make_optimizer(chunk.parameters(), cfg),
        loss_fn(cfg.model),
        autocast_dtype=autocast_dtype(cfg),
        stage=stage,
        pp=pp,
        schedule=cfg.schedule,
        rank=rank,
        stride=dp * tp,
        pp_group=mesh["pp"].get_group(),
        dp_group=dp_group,
        fsdp=dp > 1 and reshard is not None,
        sequence_shards=tp if cfg.sequence_parallel else 1,
    )
    runner.grad_sync = experts.sync if experts is not None else None
    return runner
