"""A simulated rank equals a real one: the same small config simulated at world size 2
and trained on 2 real engines gives the same figures, category by category, within 5%."""

from __future__ import annotations

import pytest

import nbpar

KEYS = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "peak_bytes", "comm_bytes")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "tp"])
def test_simulated_rank_matches_the_real_engines(pool, strategy):
    gpt = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=2, seq_len=16)
    cfg = nbpar.TrainConfig(strategy=strategy, gpt=gpt, micro_batch=4, steps=2)
    real = pool.train(cfg).result()["ranks"]
    sim = nbpar.simulate(cfg, 2)
    (simulated,) = sim["ranks"]
    assert simulated["stands_for"] == [0, 1]
    for r in real:
        for key in KEYS:
            assert simulated[key] == pytest.approx(r[key], rel=0.05), (strategy, key)
        assert simulated["comm_bytes_by_op"].keys() == r["comm_bytes_by_op"].keys()
