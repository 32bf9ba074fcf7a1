"""Expert parallelism on real gloo processes against one process: tiny_moe trained with
strategy ep (k = 1 and 2; ep = 4, and ep = 2 < dp = 4) and inside hybrid (ep x tp, ep x
pp) equals strategy single on the same global batch within 1e-5 over 20 steps; the
routing the ranks report adds up to single's; a metered step's bytes are what theory
says: the all-to-alls follow the measured routing (two per MoE layer forward, two
backward), the gradient all-reduces the replicated and the expert bytes; the expert
parameters a rank holds fall with ep."""

from __future__ import annotations

import pytest
import torch

from nbpar.config import GPTConfig, MoEConfig, TrainConfig
from nbpar.dims import ParallelDims
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(900)

STEPS, MICRO, ACCUM, WORLD, EXPERTS = 20, 2, 2, 4, 4
GPT = dict(seq_len=16, d_model=32, n_heads=4, n_layers=2)
METERED = 2  # the loop meters a run's third step


def _cfg(k=2, **kw) -> TrainConfig:
    base = dict(
        model="tiny_moe",
        steps=STEPS,
        seed=3,
        lr=3e-3,
        grad_accum=ACCUM,
        gpt=GPTConfig(**GPT),
        moe=MoEConfig(n_experts=EXPERTS, top_k=k),
    )
    return TrainConfig(**{**base, **kw})


def _single(k: int, dp: int) -> dict:
    """The reference: one process, each micro-batch the whole global one."""
    from nbpar.train.loop import run_training

    return run_training(_cfg(k, strategy="single", micro_batch=MICRO * dp))


def _train(rank, world, configs):
    """Every config on this rank: its losses, step records and parameter bytes."""
    from nbpar.train.loop import run_training

    out = []
    for cfg in configs:
        r = run_training(cfg)
        out.append({key: r[key] for key in ("losses", "history", "param_bytes")})
    return out


def _close(got, ref, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor(ref), atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}"
    )


def _all_to_all_theory(steps: list[dict], dims: ParallelDims, rank: int) -> float:
    """Bytes ``rank`` sends in a step's all-to-alls, from the routing its ep group's ranks
    reported for that step (``steps``: every rank's record): per MoE layer the dispatch
    sends the rows bound for the other ranks' experts and the combine sends back the rows
    the others sent to its own; backward sends both ways again; and each micro-batch one
    all-to-all of the int64 counts, E / ep to each other rank."""
    me = dims.coords(rank)
    group = [r for r in range(dims.world_size) if dims.coords(r)["edp"] == me["edp"]]
    per_rank = EXPERTS // dims.ep
    held = range(me["ep"] * per_rank, (me["ep"] + 1) * per_rank)
    row = GPT["d_model"] * 4  # one fp32 token row
    total = 0.0
    for layer, counts in steps[rank]["tokens_per_expert"].items():
        sent = sum(c for e, c in enumerate(counts) if e not in held)
        got = sum(steps[r]["tokens_per_expert"][layer][e] for r in group if r != rank for e in held)
        total += 2 * (sent + got) * row  # dispatch + combine, forward and backward
        total += ACCUM * per_rank * (dims.ep - 1) * 8  # the counts
    return total


def _check_bytes(runs: list[dict], dims: ParallelDims) -> None:
    """A metered step's all-to-all bytes against the routing, its all-reduces against
    the replicated (over dp) and expert (over the edp copies) gradient bytes."""
    steps = [run["history"][METERED] for run in runs]
    edp = dims.dp // dims.ep
    for rank, step in enumerate(steps):
        assert step["comm_metered"]
        sent = step["comm_bytes_by_op"]
        want = _all_to_all_theory(steps, dims, rank)
        assert sent["all_to_all"] == pytest.approx(want, rel=0.10), f"rank {rank}"
        assert sent["all_to_all"] == pytest.approx(want, abs=1), "every byte is accounted for"
        experts = step["expert_param_bytes"]
        dense = step["param_bytes"] - experts
        reduce = 2 * (dims.dp - 1) / dims.dp * dense + 2 * (edp - 1) / edp * experts
        assert sent["all_reduce"] == pytest.approx(reduce, rel=0.10), f"rank {rank}"


def _check_routing(runs: list[dict], ref: dict, k: int) -> None:
    """Each rank routes its own micro-batches (every token to k experts per layer); on
    the first step, before any update, the ranks' counts add up to single's."""
    for run in runs:
        for counts in run["history"][0]["tokens_per_expert"].values():
            assert sum(counts) == MICRO * ACCUM * GPT["seq_len"] * k
    first = ref["history"][0]["tokens_per_expert"]
    summed = {
        layer: [
            sum(run["history"][0]["tokens_per_expert"][layer][e] for run in runs)
            for e in range(EXPERTS)
        ]
        for layer in first
    }
    assert summed == first


def test_ep_equals_single_for_top1_and_top2_and_ep_below_dp():
    """dp = 4 in every run: ep = 4 (one expert a rank) with k = 2 and k = 1, and ep = 2
    (two copies of each expert pair); their references are single on the same batch."""
    layouts = [(2, 4), (1, 4), (2, 2)]  # (k, ep)
    configs = [_cfg(k, strategy="ep", ep=ep, micro_batch=MICRO) for k, ep in layouts]
    results = run_distributed(_train, WORLD, configs, timeout=850)
    refs = {k: _single(k, WORLD) for k in (1, 2)}
    expert_bytes = {}
    for i, (k, ep) in enumerate(layouts):
        runs = [r[i] for r in results]
        ref = refs[k]
        for rank, run in enumerate(runs):
            _close(run["losses"], ref["losses"], f"ep={ep} k={k} rank {rank}")
        dims = configs[i].dims(WORLD)
        _check_routing(runs, ref, k)
        _check_bytes(runs, dims)
        expert_bytes[(k, ep)] = {run["history"][-1]["expert_param_bytes"] for run in runs}
    # the expert parameters a rank holds fall with ep: E / ep experts each
    (at4,), (at2,) = expert_bytes[(2, 4)], expert_bytes[(2, 2)]
    assert at2 == 2 * at4
    layer = GPT["d_model"] * 4 * GPT["d_model"]  # one expert's w1 (and w2) elements
    assert at4 == GPT["n_layers"] * 4 * (2 * layer + 4 * GPT["d_model"] + GPT["d_model"])


def test_ep_inside_hybrid_with_tp_and_with_pp():
    """dp = 2 = ep with tp = 2 (each expert whole on both tp ranks), and with pp = 2
    (each stage shares out its own blocks' experts); single runs the same global batch."""
    layouts = [dict(dp=2, tp=2, ep=2), dict(dp=2, pp=2, ep=2, schedule="1f1b")]
    configs = [_cfg(2, strategy="hybrid", micro_batch=MICRO, **kw) for kw in layouts]
    results = run_distributed(_train, WORLD, configs, timeout=850)
    ref = _single(2, 2)
    for i, layout in enumerate(layouts):
        for rank, r in enumerate(results):
            _close(r[i]["losses"], ref["losses"], f"hybrid {layout} rank {rank}")
