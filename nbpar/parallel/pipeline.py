"""Pipeline parallelism with torch.distributed.pipelining.

Layer-wise model parallelism: the blocks of a TinyGPT are cut into ``pp``
stages (``pp * virtual`` for interleaving); micro-batches flow through them on
a schedule: GPipe (Huang et al. 2019, fill-drain), 1F1B (PipeDream-Flush, from the
PipeDream-2BW paper, Narayanan et al. 2021) or interleaved 1F1B (Megatron-LM, Narayanan
et al. 2021).
Every forward/backward of a micro-batch is timed to measure the bubble.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from nbpar.measure.clocks import HostClock, clock_for_device
from nbpar.model.plan import plan_of, require
from nbpar.strategies import check_pipeline_schedule

from .common import autocast_dtype as precision_dtype
from .common import make_optimizer
from .pipeline_timeline import PipelineSpans, SpanReports, span
from .runner import StepRunner
from .saved_activations import SavedActivations

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def stage_ids(pp_rank: int, pp_size: int, virtual: int = 1) -> list[int]:
    """Stages held by ``pp_rank``: round-robin, ``pp_rank + k * pp_size``."""
    return [pp_rank + k * pp_size for k in range(virtual)]


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Split ``n_layers`` blocks into ``n_stages`` contiguous runs, sizes differing <= 1."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def split_stages(
    model: nn.Module, pp_rank: int, pp_size: int, virtual: int = 1, *, in_place: bool = False
) -> list[nn.Module]:
    """The stage modules of ``pp_rank``: copies of ``model`` keeping only their part.

    The cut follows the model's declared plan (`nbpar.model.plan`): stage 0 keeps
    its ``first`` parts (embeddings), the last stage its ``last`` parts (norm, head);
    parameter names stay those of the full model. ``model`` is not modified, unless
    ``in_place`` (one chunk only): then it is cut itself, as a simulated rank does with
    the fake model it built for its stage (a copied fake tensor's views do not share its
    storage, which a memory meter would count as new memory).
    """
    plan = require(model, "pipeline")
    n_layers = len(plan.layers)
    for name, value in (("pp_size", pp_size), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    n_stages = pp_size * virtual
    if n_stages > n_layers:
        raise ValueError(
            f"cannot cut {n_layers} layers into pp*virtual = "
            f"{pp_size}*{virtual} = {n_stages} stages: need at most one "
            f"stage per layer"
        )
    keys = sorted(plan.layers.keys(), key=int)
    ranges = layer_ranges(n_layers, n_stages)
    chunks = []
    if in_place and virtual != 1:
        raise ValueError("split_stages(in_place=True) cuts one chunk; virtual must be 1")
    for s in stage_ids(pp_rank, pp_size, virtual):
        chunk = model if in_place else copy.deepcopy(model)
        layers = plan_of(chunk).layers
        for i, key in enumerate(keys):
            if i not in ranges[s]:
                del layers[key]
        for name in (plan.first if s != 0 else ()) + (plan.last if s != n_stages - 1 else ()):
            setattr(chunk, name, None)
        chunks.append(chunk)
    return chunks


def validate(cfg, pp: int, n_layers: int) -> int:
    """Check the schedule against pp and the model as built (a factory model's layers
    are known only here); return chunks per rank."""
    return check_pipeline_schedule(cfg.schedule, pp, cfg.grad_accum, n_layers)


class TimedStage(PipelineStage):
    """A PipelineStage that records when each micro-batch's F and B run.

    Every schedule (single- and multi-stage) calls ``forward_one_chunk`` and
    ``backward_one_chunk`` after its receives completed, so these spans are
    pure compute: the gaps between them are the bubble plus communication.
    ``activations`` (shared by the rank's stages) counts the bytes each
    micro-batch's forward saves for backward until its backward frees them.
    """

    def __init__(
        self,
        *args,
        events: list,
        autocast_dtype=None,
        activations: SavedActivations | None = None,
        marks: HostClock | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._events = events
        # the spans' clock: the host's on a CPU, the device stream's on a GPU (there a
        # chunk's call returns once its kernels are queued); read after the step
        self.marks = marks if marks is not None else HostClock()
        self._autocast_dtype = autocast_dtype
        self.activations = SavedActivations() if activations is None else activations

    def _record(self, mb: int, kind: str, start) -> None:
        """A span from the mark ``start`` to now, as marks (`read_spans` reads them)."""
        self._events.append(span(self.stage_index, mb, kind, start, self.marks.mark()))

    def _autocast(self):
        return (
            contextlib.nullcontext()
            if self._autocast_dtype is None
            else torch.autocast(self.device.type, dtype=self._autocast_dtype)
        )

    def _prepare_forward_infra(self, *args, **kwargs):
        """The first step infers each stage's input and output shapes and dtypes with a
        forward; it runs under the step's autocast too, or the inferred dtypes are fp32
        where the step's are bf16 (a GPU's autocast casts a stage's output; torch then
        refuses the step: "dtype mismatch: expected torch.float32 actual torch.bfloat16")."""
        with self._autocast():
            return super()._prepare_forward_infra(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        start = self.marks.mark()
        with (
            self._autocast(),
            self.activations.forward(self.stage_index, fwd_chunk_id, self.submod.parameters()),
        ):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._record(fwd_chunk_id, "F", start)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        start = self.marks.mark()
        out = super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )
        self.activations.release(self.stage_index, bwd_chunk_id)
        self._record(bwd_chunk_id, "B", start)
        return out


def default_loss(cfg):
    from nbpar.model.models import loss_fn

    return loss_fn(cfg)


class PipelineRunner(SpanReports, StepRunner):
    """Runs one schedule step per optimizer step on this rank's stage(s).

    ``train_step`` returns the mean micro-batch loss, broadcast from the last
    stage so every pp rank returns the same number. ``timeline()`` and the bubbles
    are the run's typical step (`timeline.StepTimelines`) of all pp ranks, in seconds
    from pp rank 0's step start; other ranks' clocks are mapped onto rank 0's with an
    offset measured once at construction (``timeline.clock_offset``).
    """

    def __init__(
        self,
        chunks,
        stages,
        schedule,
        optimizer,
        loss_fn,
        pp_group,
        *,
        events,
        clock,
        autocast_dtype=None,
        device_type="cpu",
        dp_group=None,
    ):
        super().__init__(
            nn.ModuleList(chunks),
            optimizer,
            loss_fn,
            autocast_dtype=autocast_dtype,
            device_type=device_type,
        )
        self.stages, self.schedule, self.pp_group = stages, schedule, pp_group
        self.pp_size = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.dp_group = dp_group
        self.spans = PipelineSpans(pp_group, events, clock, stages[0].marks)
        self._last_rank = dist.get_global_rank(pp_group, self.pp_size - 1)
        self.activations = stages[0].activations

    def peak_activation_bytes(self) -> int:
        """Peak bytes saved for backward on this rank during the last step."""
        return self.activations.peak

    def memory(self) -> dict[str, int]:
        """StepRunner's bytes plus ``activation_peak_bytes`` of the last step."""
        return {**super().memory(), "activation_peak_bytes": self.peak_activation_bytes()}

    def reduce_data_parallel_grads(self) -> None:
        """Hook for hybrid runners that average gradients over dp themselves."""

    def train_step(self, micro_batches) -> torch.Tensor:
        """One pipeline step over ``micro_batches`` (one per schedule micro-batch)."""
        if len(micro_batches) != self.schedule._n_microbatches:
            raise ValueError(
                f"expected {self.schedule._n_microbatches} micro-batches "
                f"(grad_accum), got {len(micro_batches)}"
            )
        self.optimizer.zero_grad(set_to_none=True)
        device = self.stages[0].device
        x = torch.cat([mb[0] for mb in micro_batches]).to(device)  # (m*b, s)
        y = torch.cat([mb[1] for mb in micro_batches]).to(device)  # (m*b, s)
        first = any(s.is_first for s in self.stages)
        last = any(s.is_last for s in self.stages)
        self.activations.reset()
        t0, metered = self.spans.begin()
        losses: list = []
        args = (x,) if first else ()
        self.schedule.step(*args, target=y if last else None, losses=losses if last else None)
        self.reduce_data_parallel_grads()
        self.optimizer_step()
        # The schedule averages each micro-batch loss and divides the
        # gradients by m (scale_grads): both equal the global-batch mean.
        loss = (
            torch.stack([t.detach().float() for t in losses]).mean()
            if last
            else torch.zeros((), dtype=torch.float32, device=x.device)
        )
        dist.broadcast(loss, src=self._last_rank, group=self.pp_group)
        self.spans.end(t0, metered)
        return loss


def build_stages(chunks, pp_rank, pp_size, virtual, pp_group, device, autocast_dtype):
    """Wrap this rank's chunks in TimedStages (shapes inferred on the first step)."""
    events, clock, activations = [], [0.0], SavedActivations()
    marks = clock_for_device(device.type)
    stages = [
        TimedStage(
            chunk,
            sid,
            pp_size * virtual,
            device,
            group=pp_group,
            events=events,
            autocast_dtype=autocast_dtype,
            activations=activations,
            marks=marks,
        )
        for chunk, sid in zip(chunks, stage_ids(pp_rank, pp_size, virtual))
    ]
    return stages, events, clock


def make_schedule(cfg, stages, loss_fn):
    cls = SCHEDULES[cfg.schedule]
    loss_fn = stages[0].activations.wrap_loss(loss_fn)  # the loss's saved tensors count too
    if cfg.schedule == "interleaved":
        return cls(stages, n_microbatches=cfg.grad_accum, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=cfg.grad_accum, loss_fn=loss_fn)


def _to(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)`` unless it is there already: the fake tensors of a
    simulated run (`nbpar.simulate`) cannot be moved, even onto their own device."""
    p = next(module.parameters(), None)
    return module if p is None or p.device == device else module.to(device)


def build_runner(
    model: nn.Module,
    cfg,
    mesh,
    *,
    loss_fn=None,
    prepare=None,
    runner_cls=PipelineRunner,
    **runner_kwargs,
) -> PipelineRunner:
    """Pipeline runner for ``model`` on ``mesh["pp"]`` with ``cfg.schedule``.

    ``prepare(chunk) -> chunk`` (hybrid) shards each stage module further
    (tensor / data parallel) before it is wrapped in a stage.
    """
    pp_mesh = mesh["pp"]
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    virtual = validate(cfg, pp_size, len(require(model, "pipeline").layers))
    device = torch.device(mesh.device_type)
    chunks = [_to(c, device) for c in split_stages(model, pp_rank, pp_size, virtual)]
    if prepare is not None:
        chunks = [prepare(c) for c in chunks]
    pp_group = pp_mesh.get_group()
    dtype = precision_dtype(cfg)
    stages, events, clock = build_stages(chunks, pp_rank, pp_size, virtual, pp_group, device, dtype)
    loss_fn = loss_fn or default_loss(cfg)
    schedule = make_schedule(cfg, stages, loss_fn)
    optimizer = make_optimizer([p for c in chunks for p in c.parameters()], cfg)
    return runner_cls(
        chunks,
        stages,
        schedule,
        optimizer,
        loss_fn,
        pp_group,
        events=events,
        clock=clock,
        autocast_dtype=dtype,
        device_type=device.type,
        **runner_kwargs,
    )
