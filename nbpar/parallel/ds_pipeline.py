"""Pipeline parallelism with DeepSpeed's PipelineModule (1F1B, PipeDream-Flush).

The model is cut by its declared plan into one part per stage (the same cut as torch's
pipeline), which DeepSpeed places one per stage; ``engine.train_batch``
runs ``grad_accum`` micro-batches through its own 1F1B schedule and steps the
optimizer. DeepSpeed allows ZeRO stage 0 or 1 only with its pipeline engine
(stage 2/3 would shard gradients that the pipeline still accumulates).

Its forward and backward passes are timed as torch's pipeline's are
(`nbpar.parallel.pipeline_timeline`): the engine runs each instruction of its schedule
through its ``_INSTRUCTION_MAP``; this runner gives its engine a copy in which the
forward and backward passes record a span (the k-th forward of a stage in a step is
micro-batch k: 1F1B runs them in order), so the run has a timeline and bubbles too.
"""

from __future__ import annotations

import torch
from torch import nn

from nbpar import device
from nbpar.measure.clocks import clock_for_device
from nbpar.parallel.ds_config import ds_config_for

from .deepspeed import client_optimizer, import_deepspeed, release
from .pipeline_timeline import PipelineSpans, SpanReports, span
from .runner import StepRunner


def pipeline_layers(model: nn.Module, pp: int) -> list[nn.Module]:
    """``model`` as DeepSpeed's flat layer sequence: one layer per pipeline stage, each
    the stage's part cut by the model's declared plan (`nbpar.parallel.pipeline.
    split_stages`: embeddings on the first, norm and head on the last), so any model
    with a plan runs, built-in or from transformers."""
    from nbpar.parallel.pipeline_cut import split_stages

    return [split_stages(model, stage, pp)[0] for stage in range(pp)]


def ds_config(cfg, dp: int) -> dict:
    """The DeepSpeed config of a pipeline run: the one every DeepSpeed run gets
    (`nbpar.parallel.ds_config.ds_config_for`, which holds it to ZeRO stage 0 or 1).
    What else the PipelineModule runs (a model with a plan, 1F1B, fp32/bf16, no tp) is
    `nbpar.strategies`' rule, checked with the TrainConfig."""
    config = ds_config_for(cfg, dp)
    config.setdefault("wall_clock_breakdown", False)
    return config


class DeepSpeedPipelineRunner(SpanReports, StepRunner):
    """Drives ``engine.train_batch``: one call = all micro-batches + optimizer step."""

    def __init__(self, engine, optimizer, loss_fn, device_type="cpu"):
        super().__init__(engine, optimizer, loss_fn, device_type=device_type)
        self.engine = engine
        events: list = []
        self.spans = PipelineSpans(
            engine.grid.get_pipe_parallel_group(), events, [0.0], clock_for_device(device_type)
        )
        engine._INSTRUCTION_MAP = timed_instructions(engine, events, self.spans.marks)

    def train_step(self, micro_batches) -> torch.Tensor:
        """Mean loss of this data-parallel replica's micro-batches (same on all stages)."""
        if len(micro_batches) != self.engine.gradient_accumulation_steps():
            raise ValueError(
                f"expected {self.engine.gradient_accumulation_steps()} "
                f"micro-batches (grad_accum), got {len(micro_batches)}"
            )
        t0, metered = self.spans.begin()
        self.engine.train_batch(data_iter=iter(micro_batches))
        self.spans.end(t0, metered)
        return self.engine.dp_group_loss.detach().float().reshape(())

    def set_update_rule(self, cfg, pp_group=None) -> None:
        """Nothing to do: the engine clips and schedules as its config says."""

    def parameters(self):
        return list(self.engine.module.parameters())

    def close(self) -> None:
        engine, self.engine, self.model = self.engine, None, None
        if engine is not None:
            release(engine)
        super().close()


def timed_instructions(engine, events: list, marks) -> dict:
    """A copy of ``engine``'s instruction map whose forward and backward passes each
    append a span of their stage to ``events`` (micro-batches counted per step: the
    count restarts when ``events`` is cleared)."""
    from deepspeed.runtime.pipe import schedule

    def timed(run, kind: str):
        def instruction(self, **kwargs):
            start = marks.mark()
            run(self, **kwargs)
            done = sum(e["kind"] == kind for e in events)  # this stage's k-th pass
            events.append(span(self.stage_id, done, kind, start, marks.mark()))

        return instruction

    table = dict(type(engine)._INSTRUCTION_MAP)
    table[schedule.ForwardPass] = timed(table[schedule.ForwardPass], "F")
    table[schedule.BackwardPass] = timed(table[schedule.BackwardPass], "B")
    return table


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> DeepSpeedPipelineRunner:
    """DeepSpeed PipelineModule + engine for ``model`` over all ranks of ``mesh``."""
    deepspeed = import_deepspeed()  # CPU-safe: no C++ build, no linker noise
    from deepspeed.pipe import PipelineModule

    if loss_fn is None:
        from nbpar.model.models import loss_fn as make_loss

        loss_fn = make_loss(cfg)
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    deepspeed.init_distributed(dist_backend=device.current_backend(), auto_mpi_discovery=False)
    module = PipelineModule(
        layers=pipeline_layers(model, pp),
        num_stages=pp,
        loss_fn=loss_fn,
        partition_method="uniform",
    )
    config = ds_config(cfg, dp)
    optimizer = client_optimizer(config.pop("optimizer"), list(module.parameters()))
    engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return DeepSpeedPipelineRunner(engine, optimizer, loss_fn, device_type=mesh.device_type)
