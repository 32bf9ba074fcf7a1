"""Tensor parallelism around the blocks: the embedding split by vocabulary, the output
layer by columns, and the sequence-parallel ends (`nbpar.parallel.tensor` splits the
blocks).

The token embedding is Megatron's VocabParallelEmbedding (Shoeybi et al. 2019): each tp
rank holds vocab/tp rows, looks up the ids in its range and zeros the others, and the
lookups are summed over the ranks (all-reduced, or reduce-scattered to this rank's s/tp
tokens under sequence parallelism). DTensor's own ``RowwiseParallel`` on an embedding
computes the same forward but gives the weight a whole (Replicate) gradient in torch
2.13, a vocab x d tensor on every rank; here the lookup runs on the local rows, so the
gradient is the local rows too. The output layer is ``ColwiseParallel`` with its logits
gathered (transformers' ``colwise_gather_output``).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from nbpar.model.plan import split_ends


class VocabParallelEmbedding(nn.Embedding):
    """``embedding`` split by vocabulary rows over the 1-D ``mesh``; its output (b, s, d)
    is summed over the ranks into ``output`` (Replicate: whole; Shard(1): this rank's
    s/tp tokens). Same parameter name (``weight``), now a Shard(0) DTensor."""

    def __init__(self, embedding: nn.Embedding, mesh, output):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            _weight=embedding.weight.detach(),
        )
        self.weight = nn.Parameter(
            distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)]),
            requires_grad=embedding.weight.requires_grad,
        )
        self.mesh, self.output = mesh, output
        # Shard(0) deals rows as torch.chunk does: ceil(vocab / tp) a rank
        self.start = mesh.get_local_rank() * math.ceil(self.num_embeddings / mesh.size())

    def forward(self, ids):
        from torch.distributed.tensor import DTensor, Partial

        rows = self.weight.to_local()  # (vocab/tp, d); its gradient stays local
        outside = (ids < self.start) | (ids >= self.start + rows.shape[0])
        pad = self.padding_idx
        if pad is not None:
            pad = pad - self.start if 0 <= pad - self.start < rows.shape[0] else None
        local = F.embedding((ids - self.start).masked_fill(outside, 0), rows, pad)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)  # (b, s, d), partial
        summed = DTensor.from_local(local, self.mesh, (Partial(),), run_check=False)
        return summed.redistribute(placements=(self.output,)).to_local()


def apply_ends(model: nn.Module, plan, tp_mesh, sequence_parallel: bool) -> None:
    """Split the parts around the blocks that this module (a model or a pipeline stage)
    holds, in place: the embedding by vocabulary, the output layer by columns and, with
    sequence parallelism, the final norm on s/tp tokens and the embeddings' output
    (a tied embedding, or TinyGPT's position embeddings) cut to this rank's tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tokens = Shard(1) if sequence_parallel else Replicate()  # (b, s/tp, d) or (b, s, d)
    ends = split_ends(model, plan)
    if plan.embed in ends:
        setattr(model, plan.embed, VocabParallelEmbedding(ends[plan.embed], tp_mesh, tokens))
    styles = {}
    if plan.head in ends:
        styles[plan.head] = ColwiseParallel(input_layouts=tokens, output_layouts=Replicate())
    if sequence_parallel and plan.norm and getattr(model, plan.norm, None) is not None:
        styles[plan.norm] = SequenceParallel()
    shards = dict(plan.sp_inputs) if sequence_parallel else {}
    if sequence_parallel and plan.embed and plan.embed not in ends:
        shards[plan.embed] = 1  # a tied embedding stays whole: take this rank's tokens
    for path, dim in shards.items():
        if getattr(model, path, None) is not None:  # the first stage's embeddings
            styles[path] = sequence_shard(dim)
    if styles:
        parallelize_module(model, tp_mesh, styles)


def sequence_shard(dim: int):
    """A style for an embedding: its output, whole on every tp rank, becomes this rank's
    s/tp of the sequence (along ``dim``) as a copy, before any block (and any checkpoint
    of one) keeps it; backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class SequenceShard(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def shard(_, inputs, out):
                whole = DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)
                return whole.redistribute(placements=(Shard(dim),)).to_local().clone()

            module.register_forward_hook(shard)
            return module

    return SequenceShard()
