"""Context-parallel attention on real gloo processes: ring (zigzag) and Ulysses each equal
one process's causal attention over the whole sequence, forward and backward, and send
the bytes their algorithms say."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed

B, H, S, D = 2, 4, 16, 8


def _full(seed: int = 0, kv: int = H):
    """q, k, v over the whole sequence (k and v with ``kv`` heads) and an upstream
    gradient, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, heads, S, D, generator=g, dtype=torch.float64) for heads in (H, kv, kv, H)
    ]


def _attend(rank, world, kind, kv=H):
    import torch.nn.functional as F

    from nbpar.measure.comm import CommMeter
    from nbpar.parallel.context import context_attention, local_positions

    q, k, v, grad = _full(kv=kv)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv != H)
    want.backward(grad)
    pos = local_positions(kind, S, world, rank)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    with CommMeter() as meter:
        out = context_attention(kind, *mine)
        out.backward(grad[:, :, pos])
    errors = {"out": (out - want[:, :, pos]).abs().max().item()}
    for name, t, ref in zip("qkv", mine, full):
        errors[f"d{name}"] = (t.grad - ref.grad[:, :, pos]).abs().max().item()
    return errors, meter.by_op(), meter.calls


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_equals_one_process(kind, cp):
    block = B * H * (S // cp) * D * 8  # one rank's q (or k, or v) in bytes, fp64
    for errors, by_op, _ in run_distributed(_attend, cp, kind):
        assert max(errors.values()) < 1e-10, errors
        if kind == "ulysses":
            # 4 all-to-alls forward (q, k, v, out), 4 backward, each (cp-1)/cp of a block
            assert set(by_op) == {"all_to_all"}, by_op
            assert by_op["all_to_all"] == pytest.approx(8 * block * (cp - 1) / cp)
        else:
            # forward: cp-1 K/V pairs; backward: cp-1 K/V pairs and cp dK/dV pairs
            assert set(by_op) == {"send_recv"}, by_op
            assert by_op["send_recv"] == pytest.approx(2 * block * (2 * (cp - 1) + cp))


@pytest.mark.parametrize(("kind", "cp"), [("ring", 2), ("ulysses", 2), ("ulysses", 4)])
def test_grouped_query_attention_equals_one_process(kind, cp):
    """Llama's 2 key/value heads for 4 query heads: the ring passes K/V blocks of 2 heads
    (and their gradients, summed over each group); Ulysses splits them where cp divides
    2, and repeats them to the 4 query heads first where it does not (cp = 4)."""
    kv = 2
    q_block = B * H * (S // cp) * D * 8  # one rank's q in bytes, fp64
    kv_block = q_block * kv // H
    for errors, by_op, _ in run_distributed(_attend, cp, kind, kv):
        assert max(errors.values()) < 1e-10, errors
        if kind == "ring":
            assert by_op == {"send_recv": pytest.approx(2 * kv_block * (2 * (cp - 1) + cp))}
        else:
            moved_kv = kv_block if kv % cp == 0 else q_block  # as split, or repeated
            want = 2 * (2 * q_block + 2 * moved_kv) * (cp - 1) / cp
            assert by_op == {"all_to_all": pytest.approx(want)}, by_op


def test_bad_splits_are_refused_in_one_line():
    from nbpar.parallel.context import contiguous_positions, zigzag_positions

    with pytest.raises(ValueError, match="does not divide by 8"):
        zigzag_positions(20, 4, 0)
    with pytest.raises(ValueError, match="does not divide by cp = 3"):
        contiguous_positions(16, 3, 0)
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def _few_heads(rank, world):
    import torch

    from nbpar.parallel.context import ulysses_attention

    q = torch.zeros(1, 3, 4, 8)
    try:
        ulysses_attention(q, q, q)
    except ValueError as err:
        return str(err)
    return None


def test_ulysses_refuses_heads_that_do_not_divide():
    for said in run_distributed(_few_heads, 2):
        assert said is not None and "3 heads do not divide by 2" in said


def _traced(rank, world):
    from nbpar.parallel.context import context_attention, local_positions
    from nbpar.parallel.ring_trace import RingTrace

    q, k, v, grad = _full()
    pos = local_positions("ring", S, world, rank)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    context_attention("ring", *mine).sum().backward()  # untraced: nothing recorded
    with RingTrace() as trace:
        context_attention("ring", *mine).backward(grad[:, :, pos])
    return trace.spans


def test_a_ring_trace_shows_each_block_computed_while_the_next_travels():
    """Forward: cp compute steps, and cp - 1 transfers each posted before the compute of
    its step begins (the next block travels meanwhile); backward: cp of each."""
    cp = 4
    for spans in run_distributed(_traced, cp):
        fwd = [s for s in spans if s["pass"] == "forward"]
        computes = [s for s in fwd if s["kind"] == "compute"]
        transfers = [s for s in fwd if s["kind"] == "transfer"]
        assert [s["step"] for s in computes] == list(range(cp))
        assert [s["step"] for s in transfers] == list(range(cp - 1))
        for t in transfers:
            c = computes[t["step"]]
            assert t["start"] <= c["start"] < c["end"] <= t["end"]  # in flight meanwhile
        back = [s for s in spans if s["pass"] == "backward"]
        assert len(back) == 2 * cp and min(s["start"] for s in spans) == 0.0
