"""The mixture-of-experts feed-forward of tiny_moe, and the routing counters every MoE
model of nbpar keeps.

A top-k router (Shazeer et al. 2017) sends each token to k of E expert FFNs and adds
their outputs weighted by its router probabilities: k = 1 is the Switch Transformer's
rule (Fedus et al. 2021: the chosen expert's probability, so the router learns from the
loss), k > 1 GShard's and Mixtral's (Lepikhin et al. 2020; Jiang et al. 2024: the k
probabilities renormalised to sum to 1). No expert has a capacity: every token reaches
its k experts (dropless, as in MegaBlocks, Gale et al. 2022).

The experts are stored as transformers 5 stores Mixtral's: one 3-D tensor per weight,
expert first (``w1``: (E, f, d)), and they are called as transformers calls its experts,
``experts(hidden (T, d), top_k_index (T, k), top_k_weights (T, k))``; expert parallelism
(`nbpar.parallel.expert`) replaces that one module, for tiny_moe and hf:mixtral alike.

The load-balancing loss is the Switch loss ``E * sum_e f_e P_e`` (f_e: share of the
token-to-expert assignments that went to expert e, P_e: mean router probability of e)
computed per sequence, as DeepSeek-V3's sequence-wise balance loss (DeepSeek-AI 2024),
not per batch: a batch statistic would differ between one process running the global
micro-batch and data-parallel ranks each running their share of it, while the mean of
per-sequence losses is the same however the sequences are dealt out. So every strategy
equals strategy single without an extra collective.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn

_COUNTING = [True]  # off while a pipeline stage infers its shapes (`routing_paused`)
_ASSUMED = [False]  # on inside `uniform_routing` (a simulation on fake tensors)


class TopKRouter(nn.Module):
    """Router logits, the top-k experts of each token and their weights (Mixtral's
    ``MixtralTopKRouter`` interface: (logits, weights, index))."""

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model).normal_(0.0, 0.02))

    def forward(self, h: torch.Tensor):
        logits = F.linear(h, self.weight)  # (T, d) @ (d, E) -> (T, E)
        probs = logits.float().softmax(-1)
        weights, index = probs.topk(self.top_k, dim=-1)  # (T, k) each
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        count_routed(self, index)
        return logits, weights, index


class Experts(nn.Module):
    """E GELU FFNs (d -> f -> d), their weights stacked expert first."""

    def __init__(self, n_experts: int, d_model: int, width: int):
        super().__init__()
        self.num_experts = n_experts
        e, d, f = n_experts, d_model, width
        self.w1 = nn.Parameter(torch.empty(e, f, d).normal_(0.0, 0.02))  # up
        self.b1 = nn.Parameter(torch.zeros(e, f))
        self.w2 = nn.Parameter(torch.empty(e, d, f).normal_(0.0, 0.02))  # down
        self.b2 = nn.Parameter(torch.zeros(e, d))

    def forward(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """(T, d) tokens, (T, k) expert ids and weights -> (T, d) weighted sum of each
        token's k expert outputs. Every expert runs, on however many tokens it got (none
        included), so each keeps a gradient (zeros where unused) every step."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = assigned(top_k_index, e, self.num_experts)  # (n_e,) each
            x = hidden[token]  # (n_e, d)
            y = F.linear(F.gelu(F.linear(x, self.w1[e], self.b1[e])), self.w2[e], self.b2[e])
            weight = top_k_weights[token, slot, None].to(y.dtype)  # (n_e, 1)
            out.index_add_(0, token, (y * weight).to(out.dtype))  # (n_e, d) into (T, d)
        return out


class MoEFeedForward(nn.Module):
    """Router + experts in place of a block's FFN: (b, s, d) -> (b, s, d); the block's
    balance loss per sequence, (b,), is left in ``aux`` for the model to add up."""

    def __init__(self, cfg, moe):
        super().__init__()
        self.router = TopKRouter(cfg.d_model, moe.n_experts, moe.top_k)
        self.experts = Experts(moe.n_experts, cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.aux_loss_coef = float(moe.aux_loss_coef)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        logits, weights, index = self.router(flat)  # (T, E), (T, k), (T, k)
        y = self.experts(flat, index, weights)  # (T, d)
        self.aux = self.aux_loss_coef * balance_loss(logits.view(b, s, -1), index.view(b, s, -1))
        return y.view(b, s, d)


def balance_loss(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Switch's ``E * sum_e f_e P_e`` of each sequence: (b, s, E) router logits and
    (b, s, k) chosen experts -> (b,); 1 when routing is uniform. f counts assignments
    (no gradient), P carries the router's gradient."""
    b, s, n = logits.shape
    probs = logits.float().softmax(-1).mean(1)  # P: (b, E)
    flat = index.reshape(b, -1)  # (b, s k)
    counts = torch.zeros(b, n, device=logits.device).scatter_add_(
        1, flat, torch.ones(flat.shape, device=logits.device)
    )  # (b, E)
    return n * (counts / flat.shape[1] * probs).sum(-1)


def moe_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """tiny_moe's loss: next-token cross entropy of the (b, s, vocab) logits plus the
    mean over sequences of the per-sequence balance loss the model returns beside them."""
    logits, aux = output
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return lm + aux.float().mean()


# ---- the routing a simulation assumes -------------------------------------------------


@contextlib.contextmanager
def uniform_routing():
    """Inside, experts take an assumed routing instead of the router's choices: of a
    step's T k token-to-expert assignments (token-major), assignment r goes to expert
    r mod E, so each expert gets T k / E rows (one more or less). Fake tensors
    (`nbpar.simulate`) have shapes and no values, and how many tokens each expert gets
    is data; the balanced routing the load-balancing loss aims at is what a simulation
    can stand behind. A real run's imbalance makes its busiest expert rank hold and
    send more (the routing figures of a real run say how much)."""
    _ASSUMED[0] = True
    try:
        yield
    finally:
        _ASSUMED[0] = False


def routing_assumed() -> bool:
    """Whether experts take `uniform_routing`'s assignment now."""
    return _ASSUMED[0]


def assigned(top_k_index: torch.Tensor, e: int, num_experts: int):
    """(token, slot) of the rows expert ``e`` gets from the (T, k) chosen experts: where
    the router chose it, or under `uniform_routing` every E-th assignment from ``e``."""
    if not _ASSUMED[0]:
        return torch.where(top_k_index == e)
    t, k = top_k_index.shape
    rows = torch.arange(e, t * k, num_experts, device=top_k_index.device)
    return rows // k, rows % k


def uniform_counts(assignments: int, num_experts: int) -> list[int]:
    """Rows per expert under `uniform_routing` for ``assignments`` (T k) rows."""
    return [len(range(e, assignments, num_experts)) for e in range(num_experts)]


def stacked_swiglu_forward(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts with stacked ``gate_up_proj`` (E, 2f, d) and ``down_proj``
    (E, d, f) (Mixtral's), their eager loop with `assigned` rows: what a simulation puts
    in place of a forward that asks which experts were hit (data)."""
    out = torch.zeros_like(hidden)
    for e in range(self.num_experts):
        token, slot = assigned(top_k_index, e, self.num_experts)
        gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        y = y * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def assume_uniform_routing(model: nn.Module) -> nn.Module:
    """Give every stacked-SwiGLU experts module of ``model`` (transformers' Mixtral) the
    forward `stacked_swiglu_forward`, in place, by a subclass of its own class (no
    method bound on the instance: that is a reference cycle, and fake tensors freed by
    the cyclic collector crashed later steps); tiny_moe's experts follow
    `uniform_routing` themselves."""
    for m in model.modules():
        if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "num_experts"):
            m.__class__ = _uniform_class(type(m))
    return model


_UNIFORM: dict[type, type] = {}


def _uniform_class(cls: type) -> type:
    """``cls`` with `stacked_swiglu_forward` as its forward, under the same name."""
    if cls in _UNIFORM.values():
        return cls
    if cls not in _UNIFORM:
        _UNIFORM[cls] = type(cls.__name__, (cls,), {"forward": stacked_swiglu_forward})
    return _UNIFORM[cls]


# ---- routing counters: tokens per expert per layer, read once per step -----------------


def count_routed(module: nn.Module, index: torch.Tensor) -> None:
    """Add the (T, k) expert ids of one forward to ``module.routed`` ((E,) counts): not
    while a checkpointed block recomputes in backward, nor for a stage's shape probe."""
    if (
        not _COUNTING[0]
        or _ASSUMED[0]
        or index.device.type == "meta"
        or torch._C._current_graph_task_id() != -1
    ):
        return
    counts = torch.bincount(index.detach().reshape(-1), minlength=module.num_experts)
    previous = getattr(module, "routed", None)
    module.routed = counts if previous is None else previous + counts


def count_router_output(module: nn.Module, args, output) -> None:
    """A forward hook for a transformers router, whose output is (logits, weights, index)."""
    count_routed(module, output[2])


@contextlib.contextmanager
def routing_paused():
    """Forwards inside do not count (a pipeline stage's first forward infers shapes)."""
    _COUNTING[0] = False
    try:
        yield
    finally:
        _COUNTING[0] = True


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def take_routing(model: nn.Module) -> dict[str, list[int]] | None:
    """Tokens this rank sent to each expert since the last call, per MoE layer
    ({layer: [count per expert]}, every micro-batch of the step, k per token), and reset
    the counters; None for a model without routers."""
    out = {}
    for name, module in model.named_modules():
        counts = getattr(module, "routed", None)
        if counts is None:
            continue
        match = _LAYER.search(name + ".")
        out[match.group(1) if match else name] = [int(c) for c in counts.tolist()]
        module.routed = None
    return out or None
