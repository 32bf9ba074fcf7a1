"""3-D parallelism: pipeline x tensor x data parallel on one ("pp","dp","tp") mesh.

The Megatron-LM recipe (Narayanan et al. 2021), composed torchtitan-style:
cut the model into pipeline stages on ``mesh["pp"]``, split each stage's
blocks Megatron-style on ``mesh["tp"]``, then replicate the stages over
``mesh["dp"]``. Data-parallel flavour, as in ``tensor.build_runner``:
``cfg.fsdp_reshard`` None -> every replica keeps full (tp-local) params and
gradients are averaged with one all-reduce over dp after the pipeline step
(DDP's math); True/False -> FSDP2 on each stage module (ZeRO-3 / ZeRO-2), whose
gradient sync the pipeline stage defers to the last micro-batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from nbpar.measure.holdings import local_tensor
from nbpar.strategies import reshard_after_forward

from . import pipeline
from .runner import StepRunner


class HybridRunner(pipeline.PipelineRunner):
    """A pipeline runner whose stages are also tensor and/or data parallel."""

    def reduce_data_parallel_grads(self) -> None:
        """Average the local gradient shards over dp with one all-reduce."""
        if self.dp_group is None:
            return
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per step
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))


def _apply_fsdp(chunk: nn.Module, dp_mesh, reshard: bool) -> nn.Module:
    """FSDP2 on one stage module: one group per block, the rest at the root."""
    try:
        from .zero import apply_fsdp
    except ImportError:  # zero.py absent: the same recipe via tensor.py's helper
        from .tensor import apply_fsdp_on_dp as apply_fsdp
    return apply_fsdp(chunk, dp_mesh, reshard)


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> StepRunner:
    """Runner for any dp x tp x pp split of ``model`` given by ``mesh``.

    With pp == 1 there is no pipeline: tensor x data parallel is
    ``tensor.build_runner``'s job and is delegated there; backend deepspeed
    goes to ``ds_pipeline`` (pp x dp, no tp).
    """
    if cfg.backend == "deepspeed":  # pp x dp via PipelineModule
        from . import ds_pipeline

        return ds_pipeline.build_runner(model, cfg, mesh, loss_fn=loss_fn)
    pp, dp, tp = mesh["pp"].size(), mesh["dp"].size(), mesh["tp"].size()
    from .tensor import apply_tp, check_tp

    if tp > 1:
        check_tp(model, tp)
    if pp == 1:
        from . import tensor

        flat = copy.copy(cfg)
        flat.strategy = "tp"
        return tensor.build_runner(model, flat, mesh, loss_fn=loss_fn)
    reshard = reshard_after_forward(cfg.strategy, cfg.fsdp_reshard)
    dp_mesh = mesh["dp"]

    def prepare(chunk: nn.Module) -> nn.Module:
        if tp > 1:
            apply_tp(chunk, mesh["tp"], cfg.sequence_parallel)
        if dp > 1 and reshard is not None:
            _apply_fsdp(chunk, dp_mesh, reshard)
        return chunk

    dp_group = dp_mesh.get_group() if dp > 1 and reshard is None else None
    return pipeline.build_runner(
        model,
        cfg,
        mesh,
        loss_fn=loss_fn,
        prepare=prepare,
        runner_cls=HybridRunner,
        dp_group=dp_group,
    )
