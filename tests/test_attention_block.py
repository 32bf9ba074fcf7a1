"""One block of attention with its log-sum-exp, as the ring uses it: CPU's flash kernel,
the explicit scores that stand in where a device has no flash kernel, and the adapter
of CUDA's flash ops (run here on CPU stand-ins that check every call against the CUDA
ops' own schemas) each give one process's causal attention, forward and backward, when
the blocks are merged by their log-sum-exps and each block's backward is given the
merged output and log-sum-exp. And the ring under autocast attends in autocast's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

B, H, KV, C, D = 2, 4, 2, 6, 8  # C: tokens of a chunk; the sequence is two chunks


def _cpu_pair():
    from nbpar.device import flash_attention_ops

    return flash_attention_ops(*(torch.zeros(1, 1, 2, 8) for _ in range(3)))


def _stand_ins(calls: list):
    """CPU stand-ins for CUDA's flash forward and backward: each checks its call against
    the real op's schema (torch's own checker), records it, and computes on CPU's op."""
    aten = torch.ops.aten
    cpu_fwd, cpu_bwd = _cpu_pair()
    check = torch._C._check_schema_allow_fake_script_object

    def bound(op, args, kwargs):
        check(op._schema, *args, **kwargs)
        names = [a.name for a in op._schema.arguments]
        got = {**dict(zip(names, args)), **kwargs}
        calls.append((op, got))
        return got

    def fwd(*args, **kwargs):
        a = bound(aten._scaled_dot_product_flash_attention.default, args, kwargs)
        assert a["dropout_p"] == 0.0 and a["return_debug_mask"] is False
        q, k, v = a["query"], a["key"], a["value"]
        out, lse = cpu_fwd(q, k, v, a["is_causal"], a["scale"])
        seed = torch.empty(2, dtype=torch.uint64)
        empty = torch.empty(0, dtype=q.dtype)
        return out, lse.contiguous(), None, None, q.shape[2], k.shape[2], seed, seed[0], empty

    def bwd(*args, **kwargs):
        a = bound(aten._scaled_dot_product_flash_attention_backward.default, args, kwargs)
        q, k, v, lse = a["query"], a["key"], a["value"], a["logsumexp"]
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2])
        assert a["cum_seq_q"] is None and a["cum_seq_k"] is None and a["dropout_p"] == 0.0
        assert lse.is_contiguous()  # CUDA's kernel reads it dense
        assert (a["philox_seed"].dtype, a["philox_seed"].shape) == (torch.uint64, (2,))
        return cpu_bwd(a["grad_out"], q, k, v, a["out"], lse, a["is_causal"], a["scale"])

    return fwd, bwd


def _pair(name: str, calls: list):
    from nbpar.device import cuda_flash_pair
    from nbpar.parallel import attention_block

    if name == "flash":
        return _cpu_pair()
    if name == "explicit":
        return attention_block.explicit_forward, attention_block.explicit_backward
    return cuda_flash_pair(*_stand_ins(calls))


def _two_chunks(forward, backward, q, k, v, grad):
    """Causal attention of a two-chunk sequence in three block calls (chunk 0 over chunk
    0, causal; chunk 1 over chunk 0, whole; chunk 1 over chunk 1, causal), merged as the
    ring merges them; backward per block against the merged out and lse."""
    from nbpar.parallel.context import _merge

    first, second = slice(0, C), slice(C, None)
    scale = 0.3  # not the default 1/sqrt(d): the scale must reach the kernel
    calls = [(first, first, True), (second, first, False), (second, second, True)]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for rows, keys, causal in calls:
        o, m = forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale)
        _merge(out, lse, rows, o, m)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rows, keys, causal in calls:
        got = backward(
            *(t[:, :, rows] for t in (grad, q)),
            *(t[:, :, keys] for t in (k, v)),
            *(t[:, :, rows] for t in (out, lse)),
            causal,
            scale,
        )
        for total, part, where in zip(grads, got, (rows, keys, keys)):
            total[:, :, where] += part
    return out, grads


@pytest.mark.parametrize("kv", [H, KV])
@pytest.mark.parametrize("name", ["flash", "explicit", "cuda adapter on CPU stand-ins"])
def test_a_block_pair_merged_by_log_sum_exp_equals_one_process(name, kv):
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, H, 2 * C, D, generator=g, dtype=torch.float64) for _ in "qg")
    k, v = (torch.randn(B, kv, 2 * C, D, generator=g, dtype=torch.float64) for _ in "kv")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, scale=0.3, enable_gqa=kv != H)
    want.backward(grad)
    calls = []
    out, grads = _two_chunks(*_pair(name, calls), q, k, v, grad)
    torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=0)
    for got, ref in zip(grads, full):
        torch.testing.assert_close(got, ref.grad, atol=1e-12, rtol=0)
    if name.startswith("cuda"):
        assert len(calls) == 6  # three forward calls, three backward


def test_cpu_blocks_run_on_the_flash_op_and_other_devices_on_explicit_scores():
    from torch.utils._python_dispatch import TorchDispatchMode

    from nbpar.device import flash_attention_ops
    from nbpar.parallel.attention_block import block_ops, explicit_backward, explicit_forward

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    seen = []
    q = torch.zeros(1, 2, 4, 8)
    forward, _ = block_ops(q, q, q)
    with Ops():
        forward(q, q, q, True, 0.3)
    assert seen == ["_scaled_dot_product_flash_attention_for_cpu.default"], seen
    meta = q.to("meta")
    assert flash_attention_ops(meta, meta, meta) is None
    assert block_ops(meta, meta, meta) == (explicit_forward, explicit_backward)


def test_the_ring_under_autocast_computes_in_its_dtype_like_one_process():
    """Llama under bf16 autocast: its rotary embedding gives fp32 q and k beside a bf16
    v. The ring (one rank of a fake group: its own block alone) attends in bf16, as
    ``scaled_dot_product_attention`` under autocast does, and its backward runs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nbpar.parallel.context import ring_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, 2 * C, D, generator=g), torch.randn(B, KV, 2 * C, D, generator=g)
    v = torch.randn(B, KV, 2 * C, D, generator=g).bfloat16()
    grad = torch.randn(B, H, 2 * C, D, generator=g).bfloat16()
    results = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        for attend in (ring_attention, _sdpa):
            mine = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attend(*mine)
            out.backward(grad)
            results.append([out, *(t.grad for t in mine)])
    finally:
        dist.destroy_process_group()
    assert results[0][0].dtype == torch.bfloat16
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
