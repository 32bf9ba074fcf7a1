"""Pipeline parallelism with DeepSpeed's PipelineModule (1F1B, PipeDream-Flush).

TinyGPT is flattened into a layer list [embedding, block 0..L-1, norm+head]
that DeepSpeed partitions uniformly over ``pp`` stages; ``engine.train_batch``
runs ``grad_accum`` micro-batches through its own 1F1B schedule and steps the
optimizer. DeepSpeed allows ZeRO stage 0 or 1 only with its pipeline engine
(stage 2/3 would shard gradients that the pipeline still accumulates).
"""

from __future__ import annotations

import torch
from torch import nn

from nbpar.parallel.ds_config import ds_config_for

from .deepspeed import client_optimizer, import_deepspeed, release
from .runner import StepRunner

PIPELINE_ZERO_STAGES = (0, 1)


class Embedding(nn.Module):
    """Stage-0 layer: token ids (b, s) -> token + position embeddings (b, s, d)."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))


class Head(nn.Module):
    """Last layer: hidden (b, s, d) -> final LayerNorm -> logits (b, s, vocab)."""

    def __init__(self, norm: nn.LayerNorm, head: nn.Linear):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """TinyGPT as DeepSpeed's flat layer sequence (the same parameter objects)."""
    blocks = [model.layers[k] for k in sorted(model.layers.keys(), key=int)]
    return [Embedding(model.tok_emb, model.pos_emb), *blocks, Head(model.norm, model.head)]


def zero_stage(cfg) -> int:
    """The ZeRO stage asked for, validated against the pipeline engine's limit."""
    stage = ((cfg.deepspeed_config or {}).get("zero_optimization") or {}).get("stage", 0)
    if cfg.strategy in ("zero1", "zero2", "zero3"):
        stage = int(cfg.strategy[-1])
    if stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(
            f"DeepSpeed's PipelineModule supports ZeRO stage 0 or 1 only (got stage {stage})"
        )
    return stage


def ds_config(cfg, dp: int) -> dict:
    """The DeepSpeed config of a pipeline run: the one every DeepSpeed run gets
    (`nbpar.parallel.ds_config.ds_config_for`), on ZeRO stage 0 or 1."""
    zero_stage(cfg)
    if cfg.precision == "fp16":
        raise ValueError("DeepSpeed pipeline runs here in precision fp32 or bf16, got 'fp16'")
    config = ds_config_for(cfg, dp)
    config.setdefault("wall_clock_breakdown", False)
    return config


def validate(cfg, mesh, n_layers: int) -> None:
    """Raise ValueError for what DeepSpeed's pipeline engine cannot run."""
    zero_stage(cfg)
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    if tp != 1:
        raise ValueError(
            f"the DeepSpeed pipeline backend has no tensor parallelism (tp={tp}); "
            f"use backend 'torch' with strategy 'hybrid'"
        )
    if pp > n_layers + 2:
        raise ValueError(
            f"cannot cut {n_layers + 2} pipeline layers (embedding, {n_layers} "
            f"blocks, head) into pp={pp} stages"
        )
    if cfg.schedule != "1f1b":
        raise ValueError(
            f"DeepSpeed's pipeline engine runs only the 1f1b schedule, got {cfg.schedule!r}"
        )


class DeepSpeedPipelineRunner(StepRunner):
    """Drives ``engine.train_batch``: one call = all micro-batches + optimizer step."""

    def __init__(self, engine, optimizer, loss_fn, device_type="cpu"):
        super().__init__(engine, optimizer, loss_fn, device_type=device_type)
        self.engine = engine

    def train_step(self, micro_batches) -> torch.Tensor:
        """Mean loss of this data-parallel replica's micro-batches (same on all stages)."""
        if len(micro_batches) != self.engine.gradient_accumulation_steps():
            raise ValueError(
                f"expected {self.engine.gradient_accumulation_steps()} "
                f"micro-batches (grad_accum), got {len(micro_batches)}"
            )
        self.engine.train_batch(data_iter=iter(micro_batches))
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


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> DeepSpeedPipelineRunner:
    """DeepSpeed PipelineModule + engine for ``model`` over all ranks of ``mesh``."""
    validate(cfg, mesh, len(model.layers))
    deepspeed = import_deepspeed()  # CPU-safe: no C++ build, no linker noise
    from deepspeed.pipe import PipelineModule

    if loss_fn is None:
        from nbpar.train.models import loss_fn as make_loss

        loss_fn = make_loss(cfg)
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    deepspeed.init_distributed(
        dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False
    )
    module = PipelineModule(
        layers=pipeline_layers(model), num_stages=pp, loss_fn=loss_fn, partition_method="uniform"
    )
    config = ds_config(cfg, dp)
    optimizer = client_optimizer(config.pop("optimizer"), list(module.parameters()))
    engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return DeepSpeedPipelineRunner(engine, optimizer, loss_fn, device_type=mesh.device_type)
