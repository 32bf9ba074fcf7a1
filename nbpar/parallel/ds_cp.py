"""DeepSpeed-Ulysses (Jacobs et al. 2023) as strategy cp on backend deepspeed.

DeepSpeed ships Ulysses in pure torch: ``deepspeed.sequence.layer.DistributedAttention``
wraps a local attention with the all-to-alls from sequence-split to head-split and back.
Here it wraps every layer's attention (the model's `set_context_attention` hook, as the
torch backend's kernels do), the rest of the step is nbpar's DeepSpeed runner, and the
engine learns the groups from an mpu: sequence parallel = the "cp" mesh dimension,
sequence-data parallel (where ZeRO shards and gradients are reduced) = "dp_cp".

DeepSpeed averages gradients over the data-parallel ranks and sums them over the
sequence-parallel ones (its Ulysses loss is the whole sequence's on every rank); a cp
rank's loss here is the mean over its own tokens, so its backward carries 1/cp of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nbpar.parallel.context import repeat_heads
from nbpar.parallel.cp import OwnTokens, apply_cp
from nbpar.parallel.deepspeed import DeepSpeedRunner, MeshMPU, import_deepspeed, initialize
from nbpar.parallel.ds_config import ds_config_for


class SequenceMPU(MeshMPU):
    """`MeshMPU` plus the sequence-parallel ("cp") and sequence-data-parallel ("dp_cp")
    groups DeepSpeed's engine asks an mpu for."""

    def get_sequence_parallel_group(self):
        return self._group("cp")

    def get_sequence_parallel_rank(self):
        return self.mesh["cp"].get_local_rank()

    def get_sequence_parallel_world_size(self):
        return self.mesh["cp"].size()

    def _dp_cp(self):
        return self.mesh["dp", "cp"]._flatten("dp_cp")  # `ParallelDims.build_mesh`'s

    def get_sequence_data_parallel_group(self):
        return self._dp_cp().get_group()

    def get_sequence_data_parallel_rank(self):
        return self._dp_cp().get_local_rank()

    def get_sequence_data_parallel_world_size(self):
        return self._dp_cp().size()


def _local_attention(q, k, v):
    """Causal attention of whole sequences over some heads: (b, s, heads, hd) each, as
    DistributedAttention hands them (k, v may have fewer heads: grouped-query)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)  # (b, s, heads, hd)


def ulysses_attend(group):
    """The model's attention hook through DeepSpeed's ``DistributedAttention`` over
    ``group``: (q, k, v) (b, heads, s/cp, hd) -> out (b, h, s/cp, hd). Key/value heads
    that do not divide by cp are repeated to the query heads first (DeepSpeed needs at
    least one whole key/value head a rank)."""
    import_deepspeed()
    from deepspeed.sequence.layer import DistributedAttention

    # batch first: scatter the heads (dim 2), gather the sequence (dim 1)
    attention = DistributedAttention(_local_attention, group, scatter_idx=2, gather_idx=1)
    cp = torch.distributed.get_world_size(group)

    def attend(q, k, v):
        if k.shape[1] % cp:
            k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, s/cp, heads, hd)
        return attention(q, k, v, batch_dim_idx=0).transpose(1, 2)

    return attend


class DeepSpeedContextRunner(OwnTokens, DeepSpeedRunner):
    """The DeepSpeed engine's step on this rank's tokens, each rank's backward carrying
    1/cp of its loss (see the module doc)."""


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> DeepSpeedRunner:
    """DeepSpeed-Ulysses over ``mesh["cp"]``, ZeRO stage as ``cfg`` says (0 unless a
    ds_config sets it) over every dp x cp rank."""
    if cfg.attention != "ulysses":  # validation refuses it; a caller may skip validate
        raise ValueError("DeepSpeed's context parallelism is Ulysses: use attention='ulysses'")
    if loss_fn is None:
        from nbpar.model.models import loss_fn as model_loss

        loss_fn = model_loss(cfg)
    cp_mesh, seq_len = mesh["cp"], cfg.gpt.seq_len
    positions = apply_cp(model, cp_mesh, "ulysses", seq_len, ulysses_attend(cp_mesh.get_group()))
    config = ds_config_for(cfg, mesh["dp"].size())
    engine = initialize(model, config, mpu=SequenceMPU(mesh))
    runner = DeepSpeedContextRunner(engine, loss_fn, config, positions=positions, seq_len=seq_len)
    runner.loss_share = 1.0 / cp_mesh.size()
    return runner
