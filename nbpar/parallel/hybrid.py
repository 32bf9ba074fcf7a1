"""3-D parallelism and more: pipeline x tensor x data (x context) parallel on one
("pp", "dp", "cp", "tp") mesh.

The Megatron-LM recipe (Narayanan et al. 2021), composed torchtitan-style:
cut the model into pipeline stages on ``mesh["pp"]``, split each stage's
blocks Megatron-style on ``mesh["tp"]``, then replicate the stages over
``mesh["dp"]``. Data-parallel flavour, as in ``tensor.build_runner``:
``cfg.fsdp_reshard`` None -> every replica keeps full (tp-local) params and
gradients are averaged with one all-reduce over dp after the pipeline step
(DDP's math); True/False -> FSDP2 on each stage module (ZeRO-3 / ZeRO-2), whose
gradient sync the pipeline stage defers to the last micro-batch. With cp > 1 every stage
attends over a sequence split across ``mesh["cp"]`` (`nbpar.parallel.cp`), and "data
parallel" means every dp x cp rank ("dp_cp"), as torchtitan's FSDP over dp_shard_cp. An
``ep`` degree shares out each stage's experts over ep of the dp ranks (`expert`), whose
rule then averages the gradients.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from nbpar.measure.holdings import local_tensor
from nbpar.strategies import reshard_after_forward

from . import pipeline
from .cp import OwnTokens, apply_cp, data_mesh, own_positions
from .runner import StepRunner


class HybridRunner(pipeline.PipelineRunner):
    """A pipeline runner whose stages are also tensor and/or data parallel."""

    #: expert parallelism's average (`expert.GradSync`), which replaces the one below
    grad_sync = None

    def reduce_data_parallel_grads(self) -> None:
        """Average the local gradient shards over dp with one all-reduce."""
        if self.grad_sync is not None:
            return self.grad_sync(self.model)
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


class ContextHybridRunner(OwnTokens, HybridRunner):
    """A hybrid runner whose stages also split every sequence over cp: the pipeline
    carries this rank's tokens, (b, s/cp) ids into the first stage, (b, s/cp, d) between
    stages."""


def _apply_fsdp(chunk: nn.Module, dp_mesh, reshard: bool) -> nn.Module:
    """FSDP2 on one stage module: one group per block, the rest at the root."""
    try:
        from .zero import apply_fsdp
    except ImportError:  # zero.py absent: the same recipe via tensor.py's helper
        from .tensor import apply_fsdp_on_dp as apply_fsdp
    return apply_fsdp(chunk, dp_mesh, reshard)


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> StepRunner:
    """Runner for any dp x cp x tp x pp split of ``model`` given by ``mesh``.

    With pp == 1 there is no pipeline: tensor x data parallel is
    ``tensor.build_runner``'s job, with cp > 1 ``cp.build_runner``'s, and is delegated
    there; backend deepspeed goes to ``ds_pipeline`` (pp x dp, no tp, no cp).
    """
    if cfg.backend == "deepspeed":  # pp x dp via PipelineModule
        from . import ds_pipeline

        return ds_pipeline.build_runner(model, cfg, mesh, loss_fn=loss_fn)
    pp, tp, cp = mesh["pp"].size(), mesh["tp"].size(), mesh["cp"].size()
    from .tensor import apply_tp, check_tp

    if tp > 1:
        check_tp(model, tp)
    if pp == 1 and cp > 1:  # context (x tensor, x data) parallel, no pipeline
        from . import cp as context

        return context.build_runner(model, cfg, mesh, loss_fn=loss_fn)
    if pp == 1 and cfg.ep and cfg.ep > 1:  # experts over ep (x tp): expert's runner
        from . import expert

        return expert.build_runner(model, cfg, mesh, loss_fn=loss_fn)
    if pp == 1:
        from . import tensor

        flat = copy.copy(cfg)
        flat.strategy = "tp"
        return tensor.build_runner(model, flat, mesh, loss_fn=loss_fn)
    reshard = reshard_after_forward(cfg.strategy, cfg.fsdp_reshard)
    data = data_mesh(mesh)  # every dp (x cp) rank: where the gradients are averaged
    seq_len = cfg.gpt.seq_len

    experts = expert_sync(cfg, mesh)

    def prepare(chunk: nn.Module) -> nn.Module:
        if tp > 1:
            apply_tp(chunk, mesh["tp"], cfg.sequence_parallel)
        if cp > 1:  # every stage attends over the split sequence, (b, s/cp, d) between
            apply_cp(chunk, mesh["cp"], cfg.attention, seq_len)
        if experts is not None:
            experts.apply(chunk)
        if data.size() > 1 and reshard is not None:
            _apply_fsdp(chunk, data, reshard)
        return chunk

    runner_kwargs = {"runner_cls": HybridRunner}
    if cp > 1:
        positions = own_positions(mesh["cp"], cfg.attention, seq_len)
        runner_kwargs = dict(runner_cls=ContextHybridRunner, positions=positions, seq_len=seq_len)
    runner = pipeline.build_runner(
        model,
        cfg,
        mesh,
        loss_fn=loss_fn,
        prepare=prepare,
        dp_group=data.get_group() if data.size() > 1 and reshard is None else None,
        **runner_kwargs,
    )
    runner.grad_sync = experts.sync if experts is not None else None
    return runner


def expert_sync(cfg, mesh):
    """Where ep > 1: what shares out each stage's experts and averages the gradients
    (`expert.ExpertSplit`); else None."""
    if not cfg.ep or cfg.ep == 1:
        return None
    from . import expert

    return expert.ExpertSplit(cfg, mesh)
