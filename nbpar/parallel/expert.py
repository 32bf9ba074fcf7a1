"""Expert parallelism: each of the ``ep`` ranks of a group holds E / ep of every MoE
layer's experts, and tokens travel to the rank holding their expert and back.

GShard's recipe (Lepikhin et al. 2020) as DeepSpeed-MoE lays it out (Rajbhandari et
al. 2022): the ep ranks are data-parallel ranks, each with its own tokens. Per MoE layer
a forward is one all-to-all of the token counts (each rank learns how many rows it will
receive), the dispatch all-to-all (each token row to the rank of its expert, uneven
splits) and the combine all-to-all (the expert outputs back, splits reversed); backward
sends the gradients of both back the way they came, two more. Nothing is dropped: there
is no capacity, a rank receives whatever its experts were chosen for (dropless, as in
MegaBlocks, Gale et al. 2022), so the step is the same arithmetic as one process's.

Gradients: the other parameters are replicated on every data-parallel rank and averaged
over dp; an expert's gradient on its rank already sums what all the ep ranks' tokens
gave it, so the ranks holding the same experts (the "edp" group, dp / ep of them) sum
theirs and divide by dp, which is the global batch's mean as single computes it.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from nbpar.measure.holdings import local_tensor, tensor_bytes
from nbpar.model.moe import routing_assumed, uniform_counts
from nbpar.model.plan import require

from .runner import StepRunner


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits along dim 0; its backward sends each
    row's gradient back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _local_experts(experts: nn.Module, lo: int, hi: int) -> nn.Module:
    """A copy of ``experts`` holding experts ``lo:hi`` only: every parameter stacked
    expert first is sliced, and it counts ``hi - lo`` experts. The whole weights are
    not copied on the way (deepcopy is told they are None)."""
    n = experts.num_experts
    held = [
        (m, name, p) for m in experts.modules() for name, p in m.named_parameters(recurse=False)
    ]
    for _, name, p in held:
        if p.dim() == 0 or p.shape[0] != n:
            raise ValueError(
                f"expert parallelism needs every expert weight stacked expert first: "
                f"{type(experts).__name__}.{name} has shape {tuple(p.shape)}, not ({n}, ...)"
            )
    local = copy.deepcopy(experts, {id(p): None for _, _, p in held})
    copies = dict(zip(experts.modules(), local.modules()))
    for m, name, p in held:
        setattr(copies[m], name, nn.Parameter(p.detach()[lo:hi].clone()))
    local.num_experts = hi - lo
    return local


class ShardedExperts(nn.Module):
    """An experts module split over the ``group``'s ranks: same call, same result, only
    E / ep experts here. ``local`` holds them (experts ``first`` .. ``first + E/ep - 1``);
    ``group`` None: ep = 1, every expert here and no token travels."""

    def __init__(self, experts: nn.Module, group):
        super().__init__()
        self.group = group
        on = group is not None
        self.ep, rank = (dist.get_world_size(group), dist.get_rank(group)) if on else (1, 0)
        self.num_experts = experts.num_experts
        self.per_rank = self.num_experts // self.ep
        self.first = rank * self.per_rank
        self.local = _local_experts(experts, self.first, self.first + self.per_rank)

    def forward(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """(T, d) tokens, their (T, k) experts and weights -> (T, d), as the whole
        experts module computes it."""
        if self.ep == 1:
            return self.local(hidden, top_k_index, top_k_weights)
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # (T k,) one row per token-expert assignment
        order = flat.argsort(stable=True)  # rows grouped by expert, so by rank
        assumed = routing_assumed()  # a simulation: the counts are data it does not have
        counts = (
            flat.new_zeros(self.num_experts)
            if assumed
            else torch.bincount(flat, minlength=self.num_experts)
        )  # (E,)
        got = self._exchange_counts(counts)  # (ep, E/ep): rows from each rank per expert
        if assumed:
            send, recv = self._uniform_splits(t * k)
            ids = torch.zeros(sum(recv), dtype=torch.long, device=flat.device)
        else:
            send = counts.view(self.ep, self.per_rank).sum(1).tolist()
            recv = got.sum(1).tolist()
            ids = torch.arange(self.per_rank, device=flat.device).repeat(self.ep)
            ids = ids.repeat_interleave(got.reshape(-1))  # (R,) the local expert of each row
        rows = _AllToAll.apply(hidden[order // k], recv, send, self.group)  # (R, d)
        ones = torch.ones(len(ids), 1, dtype=top_k_weights.dtype, device=ids.device)
        out = self.local(rows, ids[:, None], ones)  # (R, d) each row through its expert
        back = _AllToAll.apply(out, send, recv, self.group)  # (T k, d) in `order`
        back = back[order.argsort()].view(t, k, -1)  # (T, k, d) in assignment order
        return (back * top_k_weights[..., None].to(back.dtype)).sum(1)  # (T, d)

    def _uniform_splits(self, assignments: int) -> tuple[list[int], list[int]]:
        """Rows sent to and received from each rank under `uniform_routing` (every
        rank routes alike); the local experts then share the rows received in turn."""
        per_expert = uniform_counts(assignments, self.num_experts)
        send = [
            sum(per_expert[r * self.per_rank : (r + 1) * self.per_rank]) for r in range(self.ep)
        ]
        mine = sum(per_expert[self.first : self.first + self.per_rank])
        return send, [mine] * self.ep

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each rank's counts for this rank's experts: (E,) -> (ep, E / ep)."""
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        return got.view(self.ep, self.per_rank)


def apply_ep(model: nn.Module, ep_group) -> nn.Module:
    """Replace the experts module of every block ``model`` holds (a whole model or a
    pipeline stage) by its `ShardedExperts` over ``ep_group``, in place (None: ep = 1)."""
    plan = require(model, "expert")
    for block in plan.layers.values():
        block.set_submodule(
            plan.experts, ShardedExperts(block.get_submodule(plan.experts), ep_group)
        )
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts this rank holds."""
    return [p for m in model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()]


class GradSync:
    """Averages one step's gradients over the data-parallel ranks: replicated parameters
    over dp, experts summed over the ranks holding the same ones (edp), both / dp."""

    def __init__(self, dp_group, edp_group, dp: int):
        self.dp_group, self.edp_group, self.dp = dp_group, edp_group, dp

    def __call__(self, model: nn.Module) -> None:
        experts = {id(p) for p in expert_parameters(model)}
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # an expert no token reached on this rank
                p.grad = torch.zeros_like(p)
        self._average([p for p in params if id(p) not in experts], self.dp_group)
        self._average([p for p in params if id(p) in experts], self.edp_group)

    def _average(self, params, group) -> None:
        grads = [local_tensor(p.grad) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per group
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= self.dp
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))


def expert_groups(cfg, mesh):
    """(ep group, edp group, dp, ep) of ``cfg`` on this world; a group is None where it
    would hold one rank (ep = 1: no ep group, every data-parallel rank holds the same
    experts; ep = dp: no edp group, one copy of each expert)."""
    from .mesh import cached_expert_mesh

    dims = cfg.dims(dist.get_world_size())
    experts = cached_expert_mesh(dims, mesh.device_type)
    if experts is None:
        return None, mesh["dp"].get_group() if dims.dp > 1 else None, dims.dp, 1
    edp = experts.get_group("edp") if dims.dp > dims.ep else None
    return experts.get_group("ep"), edp, dims.dp, dims.ep


class ExpertSplit:
    """Expert parallelism of ``cfg`` on ``mesh`` for a caller that builds its own runner
    (a pipeline): ``apply(module)`` shares out its experts, ``sync`` averages a step."""

    def __init__(self, cfg, mesh):
        self.ep_group, edp_group, dp, _ = expert_groups(cfg, mesh)
        dp_group = mesh["dp"].get_group() if dp > 1 else None
        self.sync = GradSync(dp_group, edp_group, dp)

    def apply(self, module: nn.Module) -> nn.Module:
        return apply_ep(module, self.ep_group)


class ExpertParallelRunner(StepRunner):
    """Accumulate the micro-batches' gradients, average them (`GradSync`), step."""

    def __init__(self, *args, sync: GradSync, **kwargs):
        from nbpar.measure.metrics import CommTimer

        super().__init__(*args, **kwargs)
        self.sync = sync
        self.comm_timer = CommTimer()  # the gradient averages (the all-to-alls are in F/B)

    def train_step(self, micro_batches) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        scale = 1.0 / len(micro_batches)
        losses = [self.forward_backward(x, y, scale) for x, y in micro_batches]
        with self.comm_timer.span():
            self.sync(self.model)
        self.optimizer_step()
        return torch.stack(losses).mean()

    def memory(self) -> dict[str, int]:
        """StepRunner's bytes, and the bytes of the expert parameters held here."""
        return {
            **super().memory(),
            "expert_param_bytes": tensor_bytes(expert_parameters(self.model)),
        }

    def close(self) -> None:
        self.model = None
        super().close()


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> StepRunner:
    """Experts shared out over the "ep" ranks of ``mesh``'s dp, the rest replicated
    (and split Megatron-style where ``mesh["tp"]`` has more than one rank)."""
    from .common import autocast_dtype, make_optimizer, model_device_type

    if loss_fn is None:
        from nbpar.model.models import loss_fn as model_loss

        loss_fn = model_loss(cfg)
    ep_group, edp_group, dp, _ = expert_groups(cfg, mesh)
    if mesh["tp"].size() > 1:
        from .tensor import apply_tp

        apply_tp(model, mesh["tp"])
    apply_ep(model, ep_group)
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    return ExpertParallelRunner(
        model,
        make_optimizer(model.parameters(), cfg),
        loss_fn,
        sync=GradSync(dp_group, edp_group, dp),
        autocast_dtype=autocast_dtype(cfg),
        device_type=model_device_type(model),
    )
