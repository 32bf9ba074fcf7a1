"""Context parallelism: attention over a sequence split across the ``cp`` ranks of a group.

Each rank holds ``s / cp`` tokens of every sequence. Two ways to attend over all of them:

- **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns the
  sequence-split q, k, v into head-split ones (every rank: all ``s`` tokens of
  ``h / cp`` heads), ordinary attention runs on them, and a second all-to-all turns
  the output back. Four all-to-alls per attention in forward (q, k, v, out) and four in
  backward, each moving ``(cp - 1) / cp`` of its tensor; the heads must divide by cp.
- **Ring** (Liu et al. 2023, Ring Attention): q stays; the K/V blocks travel around the
  ring, each rank attending to the block it holds while the next one is on its way, the
  partial results merged with an online softmax (their log-sum-exp). Forward sends
  ``cp - 1`` K/V block pairs a rank; backward sends them again, and the gradients of
  each block travel with it, ``cp`` dK/dV pairs (the last hop brings them home). With a
  causal mask a contiguous split leaves the last rank the most work, so the tokens are
  dealt in the zigzag order (`zigzag_positions`): rank r holds chunks r and 2cp-1-r of
  2cp, the same amount of unmasked work on every rank.

Tensors are (batch, heads, local tokens, head dim); ``positions`` are the global
positions of this rank's tokens, which the causal mask compares. k and v may have fewer
heads than q (grouped-query attention, Ainslie et al. 2023: query head i reads key/value
head i // (h / kv)); the ring then passes the K/V blocks at their own size, and Ulysses
splits them over the ranks where the cp degree divides their heads, else repeats them to
the query heads first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nbpar.parallel.ring_trace import RingTrace

ATTENTIONS = ("ring", "ulysses")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` holds in the zigzag split: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks (``seq_len`` must divide by 2 cp)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"ring attention deals the sequence in 2 x cp = {2 * cp} chunks: seq_len "
            f"{seq_len} does not divide by {2 * cp}"
        )
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s contiguous share (what Ulysses splits)."""
    if seq_len % cp:
        raise ValueError(f"context parallel: seq_len {seq_len} does not divide by cp = {cp}")
    c = seq_len // cp
    return torch.arange(rank * c, (rank + 1) * c)


# ---- Ulysses -----------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over the first dimension (one slot per rank); its own adjoint."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # the slots laid out one after another, as the op reads them
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(b, h, s/cp, d) sequence-split -> (b, h/cp, s, d) head-split."""
    b, h, s_local, d = x.shape
    slots = x.reshape(b, cp, h // cp, s_local, d).transpose(0, 1)  # slot j: rank j's heads
    got = _AllToAll.apply(slots, group)  # slot j: my heads of rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_local, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(b, h/cp, s, d) head-split -> (b, h, s/cp, d) sequence-split, laid out as (b, s/cp,
    h, d) in memory (as SDPA returns its output), so the output projection reads it as
    (b, s/cp, h d) without copying it again."""
    b, h_local, s, d = x.shape
    slots = x.reshape(b, h_local, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # slot j: j's tokens
    got = _AllToAll.apply(slots, group)  # slot j: rank j's heads of my tokens
    # (cp, b, h/cp, s/cp, d) -> (b, s/cp, cp, h/cp, d) -> (b, s/cp, h, d) -> (b, h, s/cp, d)
    return got.permute(1, 3, 0, 2, 4).reshape(b, s // cp, cp * h_local, d).transpose(1, 2)


def ulysses_attention(q, k, v, group=None, *, causal: bool = True) -> torch.Tensor:
    """Attention of this rank's contiguous share of tokens over the whole sequence, by
    two all-to-alls around an ordinary attention (see module doc)."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp:
        raise ValueError(
            f"Ulysses splits the heads over cp = {cp} ranks: {q.shape[1]} heads do not "
            f"divide by {cp} (use attention='ring', or a cp that divides the heads)"
        )
    if k.shape[1] % cp:  # fewer key/value heads than ranks: each rank needs whole groups
        k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    q, k, v = (_seq_to_heads(t, cp, group) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]  # rank r: query heads r h/cp.., key/value r kv/cp..
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return _heads_to_seq(out, cp, group)


# ---- Ring --------------------------------------------------------------------------------


def repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv, s, d) -> (b, kv * groups, s, d): each key/value head once per query head
    of its group (transformers' ``repeat_kv``)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv * groups, s, d) -> (b, kv, s, d): the gradient of `repeat_heads`."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def _exchange(tensors, group, rank: int, cp: int) -> tuple[list[torch.Tensor], list]:
    """Send ``tensors`` to the next rank of the ring and start receiving the previous
    rank's: (the tensors being received, the works to wait for)."""
    right, left = (rank + 1) % cp, (rank - 1) % cp
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=right) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=left) for t in got]
    return got, dist.batch_isend_irecv(ops)


def _scores(q, k, q_pos, k_pos, scale):
    """Scores of q against one K block, causally masked by the tokens' global positions.
    In the zigzag split every block is partly visible to every rank (its second chunk
    comes after every first chunk), so no block is skipped, and nothing here reads a
    tensor's values on the host (which fake tensors, `nbpar.simulate`, cannot)."""
    mask = q_pos[:, None] >= k_pos[None, :]
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~mask.to(q.device), float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, seq_len):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = (k, v)
        groups = q.shape[1] // k.shape[1]  # query heads per key/value head
        trace = RingTrace.active
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                posted = trace.mark(q) if trace else None
                incoming, works = _exchange(block, group, rank, cp)
            begun = trace.mark(q) if trace else None
            owner = (rank - step) % cp
            kb, vb = (repeat_heads(t, groups) for t in block)  # (b, h, s/cp, d)
            s = _scores(q, kb, positions, zigzag_positions(seq_len, cp, owner), scale)
            blk_lse = torch.logsumexp(s, dim=-1)
            safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)
            blk_out = torch.exp(s - safe[..., None]) @ vb
            new_lse = torch.logaddexp(lse, blk_lse)
            # the first block is this rank's own, which holds every query's diagonal:
            # lse is finite from then on, so the weights below are never inf - inf
            out = (
                out * torch.exp(lse - new_lse)[..., None]
                + blk_out * torch.exp(blk_lse - new_lse).nan_to_num(0.0)[..., None]
            )
            lse = new_lse
            if trace:
                trace.add("forward", step, "compute", begun, trace.mark(q))
            if step < cp - 1:
                for w in works:
                    w.wait()
                block = tuple(incoming)
                if trace:
                    trace.add("forward", step, "transfer", posted, trace.mark(q))
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.seq_len = group, seq_len
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, positions = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        block = (k, v)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # of the block held, travelling
        groups = q.shape[1] // k.shape[1]
        trace = RingTrace.active
        for step in range(cp):
            begun = trace.mark(q) if trace else None
            owner = (rank - step) % cp
            kb, vb = (repeat_heads(t, groups) for t in block)
            s = _scores(q, kb, positions, zigzag_positions(ctx.seq_len, cp, owner), scale)
            p = torch.exp(s - lse[..., None])
            dv = dv + _fold_heads(p.transpose(-1, -2) @ grad_out, groups)
            ds = p * (grad_out @ vb.transpose(-1, -2) - delta)
            dq = dq + ds @ kb * scale
            dk = dk + _fold_heads(ds.transpose(-1, -2) @ q * scale, groups)
            if trace:
                trace.add("backward", step, "compute", begun, trace.mark(q))
            if cp == 1:
                break
            # pass the block on with its gradients; after the last step only the gradients
            # move, one hop home to their owner
            send = (*block, dk, dv) if step < cp - 1 else (dk, dv)
            posted = trace.mark(q) if trace else None
            got, works = _exchange(send, group, rank, cp)
            for w in works:
                w.wait()
            if trace:
                trace.add("backward", step, "transfer", posted, trace.mark(q))
            if step < cp - 1:
                block, (dk, dv) = tuple(got[:2]), got[2:]
            else:
                dk, dv = got
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, group=None, *, seq_len: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag share of tokens over the whole sequence,
    the K/V blocks passed around the ring (see module doc). ``seq_len`` is the whole
    sequence's length (default: cp x the local length)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = seq_len if seq_len is not None else cp * q.shape[-2]
    positions = zigzag_positions(seq_len, cp, rank)
    if positions.numel() != q.shape[-2]:
        raise ValueError(
            f"ring attention: this rank holds {q.shape[-2]} tokens where the zigzag split "
            f"of {seq_len} over cp = {cp} gives {positions.numel()}"
        )
    return _RingAttention.apply(q, k, v, positions, group, seq_len)


def context_attention(kind: str, q, k, v, group=None) -> torch.Tensor:
    """``ring_attention`` or ``ulysses_attention`` by name."""
    if kind == "ring":
        return ring_attention(q, k, v, group)
    if kind == "ulysses":
        return ulysses_attention(q, k, v, group)
    raise ValueError(f"attention={kind!r} is not supported; choose {', '.join(ATTENTIONS)}")


def local_positions(kind: str, seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds under ``kind``'s split."""
    if kind == "ring":
        return zigzag_positions(seq_len, cp, rank)
    if kind == "ulysses":
        return contiguous_positions(seq_len, cp, rank)
    raise ValueError(f"attention={kind!r} is not supported; choose {', '.join(ATTENTIONS)}")
