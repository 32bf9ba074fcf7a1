"""One block of attention with its log-sum-exp, the unit ring attention merges: on the
device's flash kernel where it has one (`nbpar.device.flash_attention_ops`; Dao et al.
2022, FlashAttention: the (q, k) scores are made and used tile by tile, never held
whole), else by explicit scores, which hold them (sq x sk a head).

Both pairs have the same interface, k and v with as many heads as q or fewer
(grouped-query attention, Ainslie et al. 2023):

    forward(q, k, v, is_causal, scale) -> (out (b, h, sq, d), lse (b, h, sq))
    backward(grad_out, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)

``is_causal`` masks the top-left triangle (query i sees keys 0..i), as SDPA's does.
backward takes any ``out`` and ``lse`` of these queries, not only the block's own: given
the whole sequence's (the ring's merged ones), P = exp(S - lse) is the whole softmax's
share of this block and dS = P * (dP - rowsum(dO * O)) its true gradient, so the
blocks' dq, dk, dv sum to the full attention's (the ring-flash-attention recipe).
"""

from __future__ import annotations

import torch

from nbpar.device import flash_attention_ops


def repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv, s, d) -> (b, kv * groups, s, d): each key/value head once per query head
    of its group (transformers' ``repeat_kv``)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def fold_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv * groups, s, d) -> (b, kv, s, d): the gradient of `repeat_heads`."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def block_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The (forward, backward) pair for these tensors: the device's flash kernel, or
    `explicit_forward` / `explicit_backward` where it has none (fp32 on a GPU)."""
    return flash_attention_ops(q, k, v) or (explicit_forward, explicit_backward)


def _scores(q, k, is_causal: bool, scale: float) -> torch.Tensor:
    """(b, h, sq, d) @ (b, h, d, sk) -> (b, h, sq, sk), top-left causal mask."""
    s = q @ k.transpose(-1, -2) * scale
    if not is_causal:
        return s
    hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return s.masked_fill(hidden, float("-inf"))


def explicit_forward(q, k, v, is_causal: bool, scale: float):
    """The block's output and log-sum-exp from its whole score matrix."""
    groups = q.shape[1] // k.shape[1]
    k, v = (repeat_heads(t, groups) for t in (k, v))
    s = _scores(q, k, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    return torch.exp(s - lse[..., None]) @ v, lse


def explicit_backward(grad_out, q, k, v, out, lse, is_causal: bool, scale: float):
    """dq, dk, dv of the block, its probabilities taken against ``lse`` (see module doc)."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = (repeat_heads(t, groups) for t in (k, v))
    p = torch.exp(_scores(q, kr, is_causal, scale) - lse[..., None])  # (b, h, sq, sk)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O), (b, h, sq, 1)
    ds = p * (grad_out @ vr.transpose(-1, -2) - delta)
    dq = ds @ kr * scale
    dk = fold_heads(ds.transpose(-1, -2) @ q * scale, groups)
    dv = fold_heads(p.transpose(-1, -2) @ grad_out, groups)
    return dq, dk, dv
