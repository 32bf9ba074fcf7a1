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
  2cp, the same amount of unmasked work on every rank. Each block is one call of the
  device's flash kernel (`nbpar.parallel.attention_block`), which gives its output and
  log-sum-exp and never holds the block's (s/cp x s/cp) scores: a rank holds O(s/cp)
  a head, as on GPUs (Liu et al.; the zigzag recipe of ring-flash-attention).

Tensors are (batch, heads, local tokens, head dim). k and v may have fewer
heads than q (grouped-query attention, Ainslie et al. 2023: query head i reads key/value
head i // (h / kv)); the ring then passes the K/V blocks at their own size, and Ulysses
splits them over the ranks where the cp degree divides their heads, else repeats them to
the query heads first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nbpar.parallel.attention_block import block_ops, repeat_heads
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


def _exchange(tensors, group, rank: int, cp: int) -> tuple[list[torch.Tensor], list]:
    """Send ``tensors`` to the next rank of the ring and start receiving the previous
    rank's: (the tensors being received, the works to wait for)."""
    right, left = (rank + 1) % cp, (rank - 1) % cp
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=right) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=left) for t in got]
    return got, dist.batch_isend_irecv(ops)


def _visible(owner: int, rank: int, local: int) -> tuple[slice, slice, bool]:
    """(this rank's query rows, the block's key rows, causal?) that see each other under
    the causal mask, when rank ``rank`` holds the K/V block of rank ``owner``. In the
    zigzag split (chunks r and 2cp-1-r of 2cp) every pair of chunks is wholly visible,
    wholly hidden or the diagonal, so each step is one call: its own block, causal (the
    local order keeps the global one); an earlier rank's, every query against its first
    chunk (its second comes after both of ours); a later rank's, our second chunk against
    both of its (our first comes before them). Decided by ranks alone, never by a
    tensor's values on the host (which fake tensors, `nbpar.simulate`, lack)."""
    every, half = slice(None), local // 2
    if owner == rank:
        return every, every, True
    if owner < rank:
        return every, slice(0, half), False
    return slice(half, None), every, False


def _merge(out, lse, rows, blk_out, blk_lse) -> None:
    """Fold a block's output and log-sum-exp over query rows ``rows`` into the running
    ones, in place (the online softmax: each side weighted by its share of the sum)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, blk_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(old - new)[..., None]
        + blk_out * torch.exp(blk_lse - new)[..., None]
    )
    lse[:, :, rows] = new


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward, each block on `block_ops` (flash where the
    device has it: nothing the size of a block's scores is held)."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        attend, ctx.attend_grad = block_ops(q, k, v)  # chosen once, for both passes
        scale = q.shape[-1] ** -0.5
        out = lse = None  # (b, h, s/cp, d), (b, h, s/cp); in lse's dtype (fp32 for bf16)
        block = (k, v)
        trace = RingTrace.active
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                posted = trace.mark(q) if trace else None
                incoming, works = _exchange(block, group, rank, cp)
            begun = trace.mark(q) if trace else None
            rows, keys, causal = _visible((rank - step) % cp, rank, q.shape[2])
            kb, vb = (t[:, :, keys] for t in block)
            blk_out, blk_lse = attend(q[:, :, rows], kb, vb, causal, scale)
            if out is None:  # its own block: every query sees its diagonal, lse finite
                out, lse = blk_out.to(blk_lse.dtype), blk_lse
            else:
                _merge(out, lse, rows, blk_out, blk_lse)
            if trace:
                trace.add("forward", step, "compute", begun, trace.mark(q))
            if step < cp - 1:
                for w in works:
                    w.wait()
                block = tuple(incoming)
                if trace:
                    trace.add("forward", step, "transfer", posted, trace.mark(q))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        attend_grad = ctx.attend_grad
        scale = q.shape[-1] ** -0.5
        dq = torch.zeros_like(q, dtype=lse.dtype)
        block = (k, v)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # of the block held, travelling
        trace = RingTrace.active
        for step in range(cp):
            begun = trace.mark(q) if trace else None
            rows, keys, causal = _visible((rank - step) % cp, rank, q.shape[2])
            g, qr, o, m = (t[:, :, rows] for t in (grad_out, q, out, lse))
            kb, vb = (t[:, :, keys] for t in block)
            # the merged out and lse: each block's share of the whole softmax's gradient
            dq_b, dk_b, dv_b = attend_grad(g, qr, kb, vb, o, m, causal, scale)
            dq[:, :, rows] += dq_b
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
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
        return dq.to(q.dtype), dk, dv, None


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
    device = q.device.type
    q, k, v = (t.to(_attention_dtype(q, k, v)) for t in (q, k, v))
    with torch.autocast(device, enabled=False):  # the ring's ops run in that dtype
        return _RingAttention.apply(q, k, v, group)


def _attention_dtype(q, k, v) -> torch.dtype:
    """What attention computes in: autocast's dtype where it is on (as
    ``scaled_dot_product_attention`` does under autocast), else q, k and v's common
    one. Under autocast Llama's rotary embedding hands back fp32 q and k beside a bf16
    v, which one kernel cannot take (nor its backward, which runs without autocast)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


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
