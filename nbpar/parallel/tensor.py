"""Megatron-LM tensor parallelism (Shoeybi et al., 2019) via DTensor, for any model
that declares a tensor-parallel plan (`nbpar.model.plan`): TinyGPT, hf:llama.

Each Block's attention and feed-forward are split across the ranks of the
"tp" mesh dimension: the first linear(s) column-wise (Megatron's ``f``: copy the
input in, all-reduce its gradient out), the second row-wise (Megatron's ``g``:
all-reduce the output in forward). Attention is split by heads. The token embedding is
split by vocabulary rows and the output layer by columns, its logits all-gathered
(`nbpar.parallel.tensor_ends`): every loss function then takes whole logits, and a
pipeline stage's output stays a plain tensor, as transformers' ``colwise_gather_output``
for Llama's ``lm_head``; torchtitan instead keeps the logits split by vocabulary and
computes the loss under ``loss_parallel``, saving the (b, s, vocab) gather. Position
embeddings and norms stay replicated; their gradients are identical on every tp rank
because everything upstream of them is replicated.

Sequence parallelism (Korthikanti et al. 2022) splits what TP leaves replicated along
the sequence: between sub-layers each rank holds its s/tp tokens, the norms (and
dropout) run on them, and each TP all-reduce becomes a reduce-scatter out of the
row-wise layer and an all-gather into the next column-wise ones, which move the same
bytes (DTensor's ``SequenceParallel`` and the ``Shard(1)`` layouts, as torchtitan's
``apply_tp``). The embedding reduce-scatters its lookups to this rank's s/tp tokens;
the last stage's final norm runs on them and the head all-gathers its input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from nbpar.measure.holdings import local_tensor
from nbpar.model.models import gpt_block_plan
from nbpar.model.plan import check_tp_degree, require
from nbpar.strategies import reshard_after_forward

from .runner import StepRunner
from .tensor_ends import apply_ends


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(require(model, "tensor").layers.items())


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides every split width of ``model``'s plan."""
    check_tp_degree(model, tp)


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Split every Block of ``model`` across the 1-D ``tp_mesh`` in place; return it.

    Shapes per rank (b batch, s sequence, d model width, f ffn width, tp ranks):
      wq, wk, wv  Colwise: (b, s, d) @ (d, d/tp) -> (b, s, d/tp) = n_heads/tp local heads
      wo          Rowwise: (b, s, d/tp) @ (d/tp, d) -> partial (b, s, d), all-reduced
      w1          Colwise: (b, s, d) @ (d, f/tp) -> (b, s, f/tp)
      w2          Rowwise: (b, s, f/tp) @ (f/tp, d) -> partial (b, s, d), all-reduced
      embedding   ids (b, s) -> partial (b, s, d) from vocab/tp rows, all-reduced
      head        Colwise: (b, s, d) @ (d, vocab/tp) -> (b, s, vocab/tp), all-gathered
    Outputs are plain local tensors (use_local_output), so Attention's
    ``view(b, s, -1, head_dim)`` sees its local heads and the module code is unchanged.
    With ``sequence_parallel`` the blocks take and give (b, s/tp, d): wo and w2
    reduce-scatter to it, the norms run on it, the sub-layers all-gather it back.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tp mesh, got {tp_mesh.ndim} dims; pass mesh['tp']")
    check_tp(model, tp_mesh.size())
    plan = require(model, "tensor")
    if sequence_parallel and plan.sp is None:
        raise ValueError(
            f"sequence parallelism needs a model that declares its sequence-parallel "
            f"split: {type(model).__name__} has none (ModelPlan.sp)"
        )
    for block in plan.layers.values():
        parallelize_module(block, tp_mesh, plan.sp if sequence_parallel else plan.tp)
    apply_ends(model, plan, tp_mesh, sequence_parallel)  # embedding, head, SP's ends
    if hasattr(model, "sequence_shards"):  # a later stage receives s/tp tokens
        model.sequence_shards = tp_mesh.size() if sequence_parallel else 1
    return model


block_plan = gpt_block_plan  # TinyGPT's Block split


def apply_fsdp_on_dp(model: nn.Module, dp_mesh, reshard_after_forward: bool) -> nn.Module:
    """FSDP2 (ZeRO-3, or ZeRO-2 without resharding) over ``dp_mesh`` on a TP model.

    Tensor-parallel DTensor parameters become 2-D (dp-sharded, tp-split), the
    torchtitan recipe; one FSDP group per Block, then the rest at the root.
    """
    from torch.distributed.fsdp import fully_shard

    for _, block in _blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


class TensorParallelRunner(StepRunner):
    """A TP (optionally x data-parallel) step: grads synced over dp once per step.

    ``dp_group`` set: plain data parallel, the local gradients of all tp-split and
    replicated parameters are averaged with one all-reduce over the dp group
    after the last micro-batch (DDP's math without its buckets). ``fsdp`` set:
    FSDP2 reduce-scatters itself; only the last micro-batch syncs.
    """

    def __init__(self, *args, dp_group=None, fsdp: bool = False, **kwargs):
        from nbpar.measure.metrics import CommTimer

        super().__init__(*args, **kwargs)
        self.dp_group = dp_group
        self.fsdp = fsdp
        self.comm_timer = CommTimer()  # times the dp all-reduce (tp's are inside DTensor)

    def train_step(self, micro_batches) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        scale = 1.0 / len(micro_batches)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            losses.append(self.forward_backward(x, y, scale))
        if self.dp_group is not None:
            self.all_reduce_grads()
        self.optimizer_step()
        return torch.stack(losses).mean()

    def all_reduce_grads(self) -> None:
        """Average this rank's local gradient shards over the dp group."""
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective
        with self.comm_timer.span():
            dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))

    def close(self) -> None:
        self.model = None
        super().close()


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> StepRunner:
    """Tensor parallel on ``mesh["tp"]``, data parallel on ``mesh["dp"]`` if dp > 1.

    dp flavour: zero1/zero2 -> FSDP2 keeping params after forward (ZeRO-2: grads
    and optimizer state sharded), zero3 -> FSDP2 resharding (ZeRO-3); an explicit
    ``cfg.fsdp_reshard`` picks FSDP2 for any strategy; tp/ddp -> replicated over
    dp with one gradient all-reduce per step (torch DDP rejects DTensor params:
    "got mixed torch.Tensor and DTensor"). ``loss_fn`` defaults to the model's.
    """
    from nbpar.parallel.common import autocast_dtype, make_optimizer, model_device_type

    if loss_fn is None:
        from nbpar.model.models import loss_fn as model_loss

        loss_fn = model_loss(cfg)
    device_type = model_device_type(model)
    apply_tp(model, mesh["tp"], cfg.sequence_parallel)
    dp_mesh = mesh["dp"]
    dp_group, fsdp = None, False
    if dp_mesh.size() > 1:
        reshard = reshard_after_forward(cfg.strategy, cfg.fsdp_reshard)
        if reshard is None:
            dp_group = dp_mesh.get_group()
        else:
            apply_fsdp_on_dp(model, dp_mesh, reshard)
            fsdp = True
    return TensorParallelRunner(
        model,
        make_optimizer(model.parameters(), cfg),
        loss_fn,
        autocast_dtype=autocast_dtype(cfg),
        device_type=device_type,
        dp_group=dp_group,
        fsdp=fsdp,
    )
