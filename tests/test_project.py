"""`nbpar.project`: a step on real hardware, estimated. Every expected time below is
written out by hand from the constants in `nbpar.hardware` (pure arithmetic, no torch)."""

from __future__ import annotations

import json

import pytest

import nbpar
from nbpar import hardware
from nbpar.cli import main
from nbpar.errors import ConfigError
from nbpar.project import project

PSI = 1e9  # parameters
TOKENS = 2**19  # a global batch of 524,288 tokens


def ddp(hw: str, **kw):
    return project({"strategy": "ddp"}, hw, params=PSI, tokens_per_step=TOKENS, **kw)


def test_ddp_all_reduce_on_one_node_of_eight_h100():
    """Psi fp32 gradients (4 bytes a parameter, torch) in a ring of 8 over NVLink 4:
    2 (n-1)/n S / bandwidth + 2 (n-1) latencies."""
    n, size = 8, 4 * PSI
    bandwidth, latency = 450e9, 3e-6  # NVLink 4 per direction, one ring step
    want = 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * latency
    est = ddp("8xH100-SXM")
    assert want == pytest.approx(0.015598, rel=1e-4)
    assert est.comm_s == {"dp all_reduce": pytest.approx(want)}
    (comm,) = est.comms
    assert comm.sent_bytes == pytest.approx(7e9) and comm.link == "NVLink 4"
    assert comm.calls == pytest.approx(1.0)
    compute = 6 * PSI * TOKENS / 8 / (989e12 * 0.4)
    assert est.compute_s == pytest.approx(compute)  # 0.994 s
    assert est.exposed_s == 0.0  # 15.6 ms inside the backward's 2/3 x 0.994 s
    assert est.step_s == pytest.approx(compute) and est.healthy


def test_ddp_all_reduce_on_two_nodes_over_400g():
    """16 ranks across 2 nodes: the ring goes at the pace of the network, one 400 Gb/s
    (50 GB/s) NIC per GPU, 5 µs a step."""
    n, size = 16, 4 * PSI
    want = 2 * (n - 1) / n * size / 50e9 + 2 * (n - 1) * 5e-6
    assert want == pytest.approx(0.15015)
    est = ddp("2x8xH100-400G")
    assert est.comm_s["dp all_reduce"] == pytest.approx(want)
    assert "InfiniBand 400" in est.comms[0].link
    compute = 6 * PSI * TOKENS / 16 / (989e12 * 0.4)  # 0.497 s, hides 0.331 s
    assert est.exposed_s == 0.0 and est.healthy
    assert est.hideable_s == pytest.approx(2 / 3 * compute)


def test_exposed_is_at_most_comm_and_healthy_flips_on_a_slow_network():
    """One 100 GbE card for 8 GPUs: 12.5/8 GB/s a GPU, the all-reduce no longer hides."""
    n, size = 16, 4 * PSI
    comm = 2 * (n - 1) / n * size / (12.5e9 / 8) + 2 * (n - 1) * 10e-6
    compute = 6 * PSI * TOKENS / 16 / (989e12 * 0.4)
    est = ddp("2x8xH100-100GbE")
    assert est.comm_s["dp all_reduce"] == pytest.approx(comm)  # 4.80 s
    assert est.exposed_s == pytest.approx(comm - 2 / 3 * compute)
    assert est.step_s == pytest.approx(compute + comm - 2 / 3 * compute)
    assert not est.healthy and est.exposed_share > 0.2
    for e in (est, ddp("8xH100-SXM"), ddp("2x8xH100-400G")):
        assert 0 <= e.exposed_s <= sum(e.comm_s.values())
    # a smaller batch shrinks the window: 8 x 2048 tokens leave 1/32 of the compute
    small = project({"strategy": "ddp"}, "2x8xH100-400G", params=PSI, tokens_per_step=16384)
    assert not small.healthy and small.exposed_s <= sum(small.comm_s.values())


def test_tensor_parallel_all_reduces_are_never_hidden():
    cfg = {"strategy": "tp", "micro_batch": 1, "precision": "bf16", "gpt": {"seq_len": 2048}}
    est = project(cfg, "8xH100-SXM", params=PSI, layers=24, d_model=2048)
    (comm,) = est.comms
    act = 1 * 2048 * 2048 * 2  # b x s x d, bf16 activations
    assert comm.calls == pytest.approx(6 * 24)  # 6 all-reduces a layer (comm_estimate)
    sent = 6 * 24 * 2 * 7 / 8 * act
    assert comm.seconds == pytest.approx(sent / 450e9 + 6 * 24 * 14 * 3e-6)
    assert not comm.hidden and est.exposed_s == pytest.approx(comm.seconds)


def test_pipeline_adds_its_bubble():
    cfg = {"strategy": "pipeline", "grad_accum": 8, "micro_batch": 1, "gpt": {"seq_len": 64}}
    est = project(cfg, "8xH100-SXM", params=PSI, layers=16, d_model=1024, world_size=4)
    assert est.bubble_s == pytest.approx(est.compute_s * 3 / 8)
    assert "Pipeline bubble" in est.table()


def test_a_measured_run_uses_its_bytes_by_op():
    run = {
        "config": {"strategy": "zero3", "micro_batch": 1, "grad_accum": 1, "gpt": {"seq_len": 16}},
        "ranks": [
            {"rank": 0, "comm_bytes_by_op": {"all_gather": 3e9, "reduce_scatter": 1.5e9}},
            {"rank": 1, "comm_bytes_by_op": {"all_gather": 3e9, "reduce_scatter": 1.4e9}},
        ],
    }
    est = project(run, "8xH100-SXM", params=PSI, tokens_per_step=TOKENS)
    assert est.comm_s == {
        "dp all_gather": pytest.approx(3e9 / 450e9 + 1 * 3e-6),
        "dp reduce_scatter": pytest.approx(1.5e9 / 450e9 + 1 * 3e-6),  # the busiest rank
    }
    assert all(c.hidden for c in est.comms)  # FSDP prefetch: the whole compute hides them
    assert est.hideable_s == pytest.approx(est.compute_s)
    run["ranks"] = [{"rank": r, "comm_bytes_by_op": None} for r in (0, 1)]
    with pytest.raises(ConfigError, match="metered no step"):
        project(run, "8xH100-SXM", params=PSI, tokens_per_step=TOKENS)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: ddp("9xH100"), "hardware"),
        (lambda: ddp("8xH100-SXM", utilisation=0), "utilisation"),
        (lambda: ddp("8xH100-SXM", utilisation=1.2), "utilisation"),
        (lambda: project({"strategy": "ddp"}, "8xH100-SXM", params=-1), "params"),
        (lambda: project({"strategy": "ddp"}, "8xH100-SXM", tokens_per_step=8), "params"),
        (lambda: ddp("8xH100-SXM", flops_per_step=-5.0), "flops_per_step"),
        (lambda: ddp("8xH100-SXM", world_size=16), "world_size"),
        (lambda: project({"strategy": "fsdp"}, "8xH100-SXM", params=PSI), "strategy"),
        (lambda: project({"model": "simple_cnn"}, "8xH100-SXM", params=PSI), "tokens_per_step"),
        (lambda: project({"strategy": "tp"}, "8xH100-SXM", params=PSI, layers=2), "d_model"),
        (lambda: project(42, "8xH100-SXM"), "run_or_config"),
        (lambda: hardware.days_to_train(1e9, 0), "tokens"),
        (lambda: hardware.days_to_train(1e9, 1e9, "B200"), "hardware"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.field == field and field in str(info.value)


def test_days_to_train_the_classic_claim():
    """ "A 1B model: ~28 days on one A100, under 12 hours on 64": with Chinchilla's 20
    tokens a parameter at 0.4 of the bf16 peak the model says 11.1 days and 4.2 hours."""
    seconds = 6 * 1e9 * 20e9 / (312e12 * 0.4)
    assert seconds == pytest.approx(961_538.46)
    assert hardware.days_to_train(1e9, 20e9, "A100-80GB") == pytest.approx(seconds / 86400)
    assert hardware.days_to_train(1e9, 20e9, "A100-80GB") == pytest.approx(11.13, abs=0.01)
    on_64 = hardware.days_to_train(1e9, 20e9, "A100-80GB", gpus=64) * 24
    assert on_64 == pytest.approx(seconds / 64 / 3600) and on_64 == pytest.approx(4.17, abs=0.01)
    assert hardware.days_to_train(1e9, 20e9, "8x8xA100-200G") * 24 == pytest.approx(on_64)


def test_the_tables_are_one_source_and_say_per_direction():
    from nbpar import device

    assert device.PEAK_BF16_TFLOPS is hardware.PEAK_BF16_TFLOPS
    assert hardware.LINKS["NVLink 4"].gbytes_per_s == 900 / 2
    assert hardware.LINKS["NVLink 3"].gbytes_per_s == 600 / 2
    assert hardware.LINKS["InfiniBand 400"].gbytes_per_s == 400 / 8
    h200 = hardware.lookup("8xH200")
    assert (h200.gpus, h200.device.memory_gb, h200.device.bf16_tflops) == (8, 141, 989)
    assert {f"{n}x8xH100-400G" for n in range(2, 9)} <= set(hardware.PRESETS)


def test_the_table_prints_the_estimate_with_its_assumptions():
    est = ddp("2x8xH100-400G")
    text = str(est)
    assert text.startswith("estimate (not a measurement)")
    assert "6 x" in text and "Kaplan" in text and "2(n-1)" in text and "slowest link" in text
    assert all(" ".join(a.split()[:4]) in " ".join(text.split()) for a in est.assumptions)
    assert nbpar.project is not None and callable(nbpar.project)
    assert nbpar.project({"strategy": "ddp"}, "8xH100-SXM", params=PSI).healthy is not None


def test_cli_project(capsys):
    argv = ["project", "--model-params", "1e9", "--strategy", "ddp", "--hardware"]
    argv += ["2x8xH100-400G", "--tokens-per-step", str(TOKENS), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["comm_s"]["dp all_reduce"] == pytest.approx(0.15015)
    assert out["healthy"] is True and out["table"].startswith("estimate")
    assert main(["project", "--list-hardware", "--json"]) == 0
    names = [h["name"] for h in json.loads(capsys.readouterr().out)["hardware"]]
    assert "8xH100-SXM" in names and "A100-80GB" in names
    assert main(["project", "--model-params", "1e9", "--hardware", "9xH100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hardware" in err and "8xH100-SXM" in err
    assert main(["project", "--model-params", "1e9"]) == 0
    assert "assumptions:" in capsys.readouterr().out
