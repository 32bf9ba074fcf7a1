"""Simulated ranks (nbpar.simulate) against theory: model states against
`estimate_memory` and the tables it reproduces (13B fp32 on one device; the ZeRO paper's
7.5B on 64 devices), bytes sent against `comm_bytes_per_step`; bad input in one line; the
process left as found, so a real run follows."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nbpar
from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.estimate import GB, estimate_memory

pytestmark = pytest.mark.timeout(600)
SMALL = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=4, seq_len=16)


def _states(rank: dict) -> int:
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]


def _psi(gpt) -> int:
    from nbpar.model.models import TinyGPT

    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(gpt).parameters())


@pytest.mark.slow
def test_model_states_match_the_estimate_for_every_data_parallel_strategy():
    psi = _psi(SMALL)
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        sim = nbpar.simulate(nbpar.TrainConfig(strategy=strategy, gpt=SMALL, micro_batch=2), 4)
        est = estimate_memory(psi, 4, strategy, backend="torch").per_rank_bytes
        (rank,) = sim["ranks"]
        assert rank["stands_for"] == [0, 1, 2, 3]
        for key, est_key in (
            ("param_bytes", "params"),
            ("grad_bytes", "grads"),
            ("optim_bytes", "optim"),
        ):
            # zero1 hands whole tensors to ranks: its optimizer share is ~1/N, not exact
            rel = 0.15 if (strategy, key) == ("zero1", "optim_bytes") else 0.05
            assert rank[key] == pytest.approx(est[est_key], rel=rel), (strategy, key)
        assert rank["peak_bytes"] > max(_states(rank), rank["activation_bytes"]) > 0


@pytest.mark.slow  # a 13B model simulated op by op
def test_13b_does_not_fit_one_device_the_fp32_table():
    """52 GB weights + 52 GB gradients + 104 GB Adam = 208 GB on one device."""
    gpt = nbpar.GPTConfig(d_model=5120, n_layers=41, n_heads=40, seq_len=16)  # 12.9B
    sim = nbpar.simulate(
        nbpar.TrainConfig(strategy="single", gpt=gpt, micro_batch=1), 1, device_memory_gb=80
    )
    (rank,) = sim["ranks"]
    for key, table in (("param_bytes", 52), ("grad_bytes", 52), ("optim_bytes", 104)):
        assert rank[key] / GB == pytest.approx(table, rel=0.05)
    assert _states(rank) / GB == pytest.approx(208, rel=0.05)
    assert sim["fits"] is False and sim["margin_bytes"] < -100 * GB


@pytest.mark.slow  # a 7.5B model simulated op by op, 4 strategies
def test_zero_paper_7_5b_on_64_devices_mixed_precision():
    """ZeRO paper Fig. 1: 120 / 31.4 / 16.6 / 1.9 GB per device. torch holds what the
    paper assumes for baseline and P_os+g+p (16 bytes a parameter in all); it holds more
    for P_os (autocast keeps fp32 weights and gradients where the paper keeps 16-bit
    copies and an fp32 master in the optimizer) and less for P_os+g (FSDP2 reshards the
    parameters after backward, so zero2 holds the same as zero3 between steps)."""
    gpt = nbpar.GPTConfig(
        d_model=8192, n_layers=9, n_heads=64, vocab_size=16000, seq_len=16
    )  # 7.51B
    psi = _psi(gpt)
    assert psi / 1e9 == pytest.approx(7.5, rel=0.01)
    got = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        sim = nbpar.simulate(
            nbpar.TrainConfig(strategy=strategy, gpt=gpt, micro_batch=1, precision="bf16"), 64
        )
        got[strategy] = _states(sim["ranks"][0]) / GB
    assert got["ddp"] == pytest.approx(120, rel=0.05)
    assert got["zero3"] == pytest.approx(1.9, rel=0.05)
    fp32_weights = estimate_memory(psi, 64, "zero1", precision="fp32").per_rank_bytes
    assert got["zero1"] > 31.4 and got["zero1"] == pytest.approx(
        fp32_weights["total"] / GB, rel=0.05
    )
    resharded = estimate_memory(psi, 64, "zero2", precision="mixed", backend="torch")
    assert got["zero2"] < 16.6 and got["zero2"] == pytest.approx(
        resharded.per_rank_bytes["total"] / GB, rel=0.05
    )


@pytest.mark.spawn  # nbpar.simulate runs a pipeline layout in spawned processes
def test_bytes_sent_match_theory():
    psi_bytes = _psi(SMALL) * 4
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        sim = nbpar.simulate(nbpar.TrainConfig(strategy=strategy, gpt=SMALL, micro_batch=2), 4)
        want = comm_bytes_per_step(strategy, param_bytes=psi_bytes, dp=4)
        assert sim["ranks"][0]["comm_bytes"] == pytest.approx(want, rel=0.05), strategy
    hidden = 2 * SMALL.seq_len * SMALL.d_model * 4  # one micro-batch's (b, s, d), fp32
    logits = 2 * SMALL.seq_len * SMALL.vocab_size * 4  # gathered by the split head
    sim = nbpar.simulate(nbpar.TrainConfig(strategy="tp", gpt=SMALL, micro_batch=2), 2)
    want = comm_bytes_per_step(
        "tp",
        param_bytes=psi_bytes,
        tp=2,
        layers=SMALL.n_layers,
        activation_bytes=hidden,
        logits_bytes=logits,
    )
    assert sim["ranks"][0]["comm_bytes"] == pytest.approx(want, rel=0.10)
    sim = nbpar.simulate(
        nbpar.TrainConfig(strategy="pipeline", gpt=SMALL, micro_batch=2, grad_accum=4), 4
    )
    assert [r["stands_for"] for r in sim["ranks"]] == [[0], [1], [2], [3]]
    for stage, rank in enumerate(sim["ranks"]):
        want = comm_bytes_per_step(
            "pipeline",
            param_bytes=psi_bytes,
            pp=4,
            grad_accum=4,
            activation_bytes=hidden,
            pp_stage=stage,
        )
        assert rank["comm_bytes"] == pytest.approx(want, rel=0.05), stage
    # 1F1B: stage i holds at most p - i micro-batches' activations
    acts = [r["activation_bytes"] for r in sim["ranks"]]
    assert acts[0] > acts[1] > acts[2]


@pytest.mark.spawn  # nbpar.simulate runs a pipeline layout in spawned processes
def test_hybrid_roles_one_per_stage():
    sim = nbpar.simulate(
        nbpar.TrainConfig(
            strategy="hybrid", dp=2, tp=2, pp=2, gpt=SMALL, micro_batch=2, grad_accum=2
        ),
        8,
    )
    assert [r["stands_for"] for r in sim["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["rank"] for r in sim["ranks"]] == [0, 4]
    first, last = (set(r["comm_bytes_by_op"]) for r in sim["ranks"])
    assert first == {"all_reduce", "send_recv"}
    assert last == {"all_reduce", "send_recv", "all_gather"}  # the head's logits gathered


def _cli(capsys, *argv):
    from nbpar.cli import main

    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--strategy", "hybrid", "--world-size", "8", "--dp", "2", "--tp", "3", "--pp", "2"],
            "dp*tp*pp = 2*3*2 = 12 must equal",
        ),
        (["--strategy", "tp", "--world-size", "8"], "tp=8 must divide gpt.n_heads=4"),
        (["--strategy", "pipeline", "--world-size", "4"], "pp=4 pipeline stages need at least 4"),
        (["--strategy", "zero3", "--world-size", "2", "--model-config", "{bad"], "not JSON"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, words):
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


class Unbuildable(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))
        self.scale = float(self.w.sum())  # a number from data: fake tensors have none


def test_a_model_that_cannot_be_built_fake_is_named(monkeypatch):
    from nbpar.model import models

    monkeypatch.setattr(models, "build_model", lambda cfg: Unbuildable())
    with pytest.raises(ValueError, match="cannot be built on fake tensors: in module Unbuildable"):
        nbpar.simulate(nbpar.TrainConfig(strategy="zero3", gpt=SMALL), 2)
    assert not dist.is_initialized()


def test_cli_json_contract_and_fit(capsys):
    code, out, _ = _cli(
        capsys,
        "--strategy",
        "zero3",
        "--world-size",
        "4",
        "--model-config",
        json.dumps({"d_model": 64, "n_layers": 2}),
        "--micro-batch",
        "2",
        "--device-memory",
        "80",
        "--json",
    )
    res = json.loads(out)
    assert code == 0 and set(res) >= {"config", "ranks", "seconds", "fits", "margin_bytes"}
    keys = {
        "rank",
        "stands_for",
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "activation_bytes",
        "peak_bytes",
        "comm_bytes",
    }
    assert keys <= set(res["ranks"][0]) and res["fits"] is True
    assert res["margin_bytes"] == 80 * 10**9 - res["ranks"][0]["peak_bytes"]
    assert res["config"]["gpt"]["d_model"] == 64


@pytest.mark.spawn  # nbpar.simulate runs a pipeline layout in spawned processes
def test_cli_for_people_prints_tables(capsys):
    from nbpar.estimate import format_bytes

    sizes = json.dumps({"d_model": 32, "n_layers": 2})
    argv = ["--strategy", "hybrid", "--world-size", "4", "--dp", "1", "--tp", "2", "--pp", "2"]
    code, out, _ = _cli(capsys, *argv, "--model-config", sizes, "--json")
    res = json.loads(out)
    code, out, _ = _cli(capsys, *argv, "--model-config", sizes, "--device-memory", "80")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].startswith(
        "hybrid/torch tiny_gpt on 4 ranks (dp 1 x tp 2 x pp 2)"
    )
    assert "fits in 80.0 GB: yes" in lines[0]
    assert lines[1].split() == [
        "ranks", "params", "grads", "optimizer", "activations", "peak", "ring/step"
    ]  # fmt: skip
    # one row per simulated role, labelled by the ranks it stands for, with the figures
    assert [line.split()[0] for line in lines[2:]] == ["0-1", "2-3"]
    for line, rank in zip(lines[2:], res["ranks"]):
        assert format_bytes(rank["peak_bytes"]).replace(" ", "") in line.replace(" ", "")
    code, out, _ = _cli(
        capsys, "--world-size", "8", "--model-config", sizes, "--device-memory", "80",
        "--what-fits",
    )  # fmt: skip
    lines = out.strip().splitlines()
    assert code == 0 and lines[0] == "what fits on 8 devices of 80 GB"
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["zero3"].split()[1:4] == ["8", "1", "1"] and " yes " in rows["zero3"]
    assert "refused: tp=8 must divide gpt.n_heads=4" in rows["tp"]


@pytest.mark.spawn  # what_fits simulates pipeline layouts in spawned processes
def test_what_fits_lists_strategies_with_margin():
    gpt = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=4, seq_len=16)
    cfg = nbpar.TrainConfig(gpt=gpt, micro_batch=2)
    single = nbpar.simulate(nbpar.TrainConfig(strategy="single", gpt=gpt, micro_batch=2), 1)
    budget = single["ranks"][0]["peak_bytes"] * 0.8 / 1e9  # one device is too small
    rows = nbpar.simulate.what_fits(cfg, 4, budget)
    by = {r["strategy"]: r for r in rows}
    assert by["zero3"]["fits"] and by["zero3"]["margin_bytes"] > 0
    assert not by["ddp"]["fits"]  # every replica holds everything
    assert [r["fits"] for r in rows] == sorted((r["fits"] for r in rows), reverse=True)


@pytest.mark.slow
def test_process_left_as_found_and_a_real_run_follows(tmp_path):
    from nbpar.train.loop import run_training

    cfg = nbpar.TrainConfig(strategy="tp", gpt=SMALL, micro_batch=2, steps=2)
    nbpar.simulate(cfg, 1)
    assert not dist.is_initialized()
    assert torch.ones(2).sum().item() == 2.0  # real tensors again
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        res = run_training(cfg)  # the same (1, 1, 1) layout, DTensor and all, for real
        assert len(res["losses"]) == 2 and all(loss > 0 for loss in res["losses"])
    finally:
        from nbpar.parallel.mesh import forget_meshes

        forget_meshes()
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero3_activations_are_those_of_ddp_once_fsdp_frees_gathered_weights():
    """What autograd saves is the same under DDP and FSDP2, plus the gathered weights of
    the block being worked on (FSDP2 re-gathers them for backward, and prefetches the
    next); the weights it frees by resizing storages must not stay counted as saved
    (they did: all 4 blocks' weights)."""
    from nbpar.model.models import Block

    cfg = {"gpt": SMALL, "micro_batch": 2}
    ddp = nbpar.simulate(nbpar.TrainConfig(strategy="ddp", **cfg), 2)["ranks"][0]
    zero3 = nbpar.simulate(nbpar.TrainConfig(strategy="zero3", **cfg), 2)["ranks"][0]
    block = sum(p.numel() * 4 for p in Block(SMALL).parameters())
    assert (
        ddp["activation_bytes"] <= zero3["activation_bytes"] < ddp["activation_bytes"] + 2 * block
    )
    assert zero3["peak_bytes"] < ddp["peak_bytes"]


LLAMA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    max_position_embeddings=4096,
)


@pytest.mark.parametrize(
    "attention, kv_heads, cp, recompute",
    [
        ("ring", 2, 4, False),
        ("ring", 2, 4, True),
        ("ulysses", 2, 2, False),
        ("ulysses", 2, 4, False),  # cp does not divide 2 heads: k, v repeated to 8
        ("ulysses", 8, 4, True),
    ],
)
def test_simulated_context_parallel_bytes_follow_their_formula(attention, kv_heads, cp, recompute):
    from nbpar.comm_estimate import context_bytes_per_step

    b, s, head_dim = 2, 256, 32
    cfg = nbpar.TrainConfig(
        model="hf:llama",
        model_config={**LLAMA, "num_key_value_heads": kv_heads},
        strategy="cp",
        cp=cp,
        attention=attention,
        activation_checkpointing="full" if recompute else None,
        micro_batch=b,
        gpt=nbpar.GPTConfig(seq_len=s),
    )
    (rank,) = nbpar.simulate(cfg, cp)["ranks"]
    moved = kv_heads if attention == "ring" or kv_heads % cp == 0 else 8
    want = context_bytes_per_step(
        attention,
        cp=cp,
        layers=4,
        kv_bytes=b * s // cp * moved * head_dim * 4,
        q_bytes=b * s // cp * 8 * head_dim * 4,
        recompute=recompute,
    )
    op = "send_recv" if attention == "ring" else "all_to_all"
    assert rank["comm_bytes_by_op"][op] == want


@pytest.mark.parametrize("ep, recompute", [(2, False), (4, False), (4, True)])
def test_simulated_expert_bytes_follow_uniform_routing(ep, recompute):
    from nbpar.comm_estimate import expert_bytes_per_step

    gpt = nbpar.GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=16)
    moe = nbpar.MoEConfig(n_experts=4, top_k=2)
    cfg = nbpar.TrainConfig(
        model="tiny_moe",
        strategy="ep",
        gpt=gpt,
        moe=moe,
        micro_batch=2,
        grad_accum=2,
        activation_checkpointing="full" if recompute else None,
    )
    (rank,) = nbpar.simulate(cfg, ep)["ranks"]
    want = expert_bytes_per_step(
        ep=ep,
        moe_layers=2,
        tokens=2 * 16,
        top_k=2,
        row_bytes=32 * 4,
        n_experts=4,
        grad_accum=2,
        recompute=recompute,
    )
    assert rank["comm_bytes_by_op"]["all_to_all"] == pytest.approx(want, abs=ep)


@pytest.mark.parametrize(
    "strategy, degrees, world",
    [
        ("ep", {}, 4),
        ("hybrid", {"dp": 2, "ep": 2, "tp": 2}, 4),
        ("tp", {}, 2),  # ep 1: the experts still stay whole on every tp rank
        ("hybrid", {"dp": 1, "cp": 2}, 2),
    ],
)
def test_the_estimate_with_cp_and_ep_equals_the_simulated_states(strategy, degrees, world):
    """The estimator's cp and ep (experts over ep, whole on every tp rank; states over dp
    x cp under FSDP2) hold what the strategy code holds, byte for byte."""
    from nbpar.estimate import estimate_config
    from nbpar.model.models import build_model
    from nbpar.model.plan import expert_parameter_count, tp_replicated_parameters

    model = "tiny_gpt" if "cp" in degrees else "tiny_moe"
    reshard = True if "cp" in degrees else None
    cfg = nbpar.TrainConfig(model=model, strategy=strategy, fsdp_reshard=reshard, **degrees)
    built = build_model(cfg)
    n, experts = sum(p.numel() for p in built.parameters()), expert_parameter_count(built)
    tp = cfg.dims(world).tp
    replicated = tp_replicated_parameters(built) - experts if tp > 1 else 0
    est = estimate_config(cfg, world, n, expert_params=experts, tp_replicated=replicated)
    (rank, *_) = nbpar.simulate(cfg, world)["ranks"]
    for key, part in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_bytes", "optim")):
        assert rank[key] == est.per_rank_bytes[part], key
