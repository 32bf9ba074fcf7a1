"""What ring attention holds grows with the sequence, not with its square: one forward
and backward on rank 1 of a fake 4-rank group (every transfer answered at once, no
process), every storage the ring's ops make counted by nbpar's step meter, at s/cp =
512 and 1024 tokens. With flash blocks the peak doubles and stays under one block's
(s/cp x s/cp) scores; the same meter sees the explicit scores (what the ring computed
before, and what a device without a flash kernel still runs) grow four times. And the
simulation, which counts what the real code allocates, answers the same: Llama's
simulated peak beyond its states doubles with the sequence at cp 8."""

from __future__ import annotations

import pytest
import torch

B, H, KV, D, CP = 1, 4, 2, 16, 4


def _ring_peak(local: int) -> int:
    """The peak bytes the ring allocates in one forward and backward of ``local`` tokens
    a rank (its inputs apart), on rank 1 of a fake group of CP."""
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nbpar.measure.memtrack import StepMemory
    from nbpar.parallel.context import ring_attention

    assert not dist.is_initialized()
    q = torch.randn(B, H, local, D, requires_grad=True)
    k, v = (torch.randn(B, KV, local, D, requires_grad=True) for _ in "kv")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=CP)
    try:
        with StepMemory(nn.Module()) as mem:
            ring_attention(q, k, v).backward(torch.ones(B, H, local, D))
    finally:
        dist.destroy_process_group()
    assert mem.error is None and q.grad is not None
    return mem.peak


def test_ring_attention_holds_memory_linear_in_the_sequence():
    short, long = _ring_peak(512), _ring_peak(1024)
    scores = B * H * 1024 * 1024 * 4  # one block's fp32 scores at 1024 tokens a rank
    assert 1.5 < long / short < 2.2, (short, long)
    assert long < scores / 2, (long, scores)


def test_the_meter_sees_explicit_scores_grow_with_the_square(monkeypatch):
    from nbpar.parallel import attention_block

    monkeypatch.setattr(attention_block, "flash_attention_ops", lambda q, k, v: None)
    short, long = _ring_peak(512), _ring_peak(1024)
    assert long / short > 3.5, (short, long)


def test_simulated_peak_of_llama_on_a_ring_of_8_grows_linearly():
    import nbpar
    from nbpar.config import GPTConfig

    llama = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
    }
    beyond_states = []
    for seq_len in (4096, 8192):
        cfg = nbpar.TrainConfig(
            strategy="cp",
            cp=8,
            attention="ring",
            model="hf:llama",
            model_config=llama,
            micro_batch=1,
            gpt=GPTConfig(seq_len=seq_len),
        )
        (rank,) = nbpar.simulate(cfg, world_size=8)["ranks"]
        states = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
        beyond_states.append(rank["peak_bytes"] - states)
        assert rank["activation_bytes"] > 0
    assert beyond_states[1] / beyond_states[0] == pytest.approx(2, abs=0.3), beyond_states
