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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_simulated_context_parallel_rank_matches_the_real_engines(pool, attention):
    gpt = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=2, seq_len=16)
    cfg = nbpar.TrainConfig(
        strategy="cp", cp=2, attention=attention, gpt=gpt, micro_batch=4, steps=2
    )
    real = pool.train(cfg).result()["ranks"]
    (simulated,) = nbpar.simulate(cfg, 2)["ranks"]
    for r in real:
        for key in KEYS:
            assert simulated[key] == pytest.approx(r[key], rel=0.05), (attention, key)
        assert simulated["comm_bytes_by_op"] == pytest.approx(r["comm_bytes_by_op"], rel=0.05)


@pytest.mark.timeout(300)
def test_simulated_expert_rank_holds_what_the_real_engines_hold(pool):
    """Expert parallelism: the states agree exactly; what travels follows the routing,
    which a simulation assumes uniform and a real run measures (its routing figures), so
    the all-to-all bytes of the simulation equal a real run's rescaled to uniform."""
    moe = nbpar.MoEConfig(n_experts=4, top_k=2)
    gpt = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=2, seq_len=16)
    cfg = nbpar.TrainConfig(
        model="tiny_moe", strategy="ep", ep=2, gpt=gpt, moe=moe, micro_batch=4, steps=2
    )
    real = pool.train(cfg).result()["ranks"]
    (simulated,) = nbpar.simulate(cfg, 2)["ranks"]
    for r in real:
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert simulated[key] == r[key], key
        assert simulated["comm_bytes_by_op"]["all_reduce"] == r["comm_bytes_by_op"]["all_reduce"]
    # uniform routing: of each rank's T k rows, half go to the other rank; four
    # all-to-alls of rows (dispatch and combine, each twice with backward) per MoE layer
    t_k = cfg.micro_batch * gpt.seq_len * moe.top_k
    rows = 4 * gpt.n_layers * (t_k // 2) * gpt.d_model * 4
    counts = gpt.n_layers * 8 * moe.n_experts // 2  # the int64 counts, half sent on
    assert simulated["comm_bytes_by_op"]["all_to_all"] == rows + counts
