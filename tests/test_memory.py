"""Analytic memory estimator: the ZeRO paper's numbers, model-parallel division, activations."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import subprocess
import sys

import pytest

from nbpar.estimate import (
    MemoryEstimate,
    activation_bytes_per_layer,
    bytes_per_param,
    estimate_memory,
    zero_table,
)

GB = 1e9
ACT = dict(batch=2, seq_len=8, hidden=16, layers=4, heads=4)


def test_classic_table_13b_fp32_adam():
    est = estimate_memory(13e9)
    assert est.per_rank_bytes == {"params": 52e9, "grads": 52e9, "optim": 104e9, "total": 208e9}
    table = est.table()
    for line in ("params 52.00 GB", "grads  52.00 GB", "optim  104.00 GB", "total  208.00 GB"):
        assert line in table
    # parts shown add up to the total shown (1.3B, mixed, ZeRO-1 on 8: 2.6 + 2.6 + 1.95)
    shown = {
        line.split()[0]: float(line.split()[1])
        for line in estimate_memory(1.3e9, 8, "zero1", precision="mixed").table().splitlines()[1:]
    }
    assert round(shown["params"] + shown["grads"] + shown["optim"], 2) == shown["total"]


def test_zero_paper_figure1_7_5b_on_64():
    rows = zero_table(7.5e9, 64)
    assert [r["name"] for r in rows] == ["baseline", "P_os", "P_os+g", "P_os+g+p"]
    assert [round(r["total_gb"], 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]


def test_bytes_per_param_and_precision_synonyms():
    assert bytes_per_param("adam", "fp32") == (4, 4, 8)
    assert bytes_per_param("adamw", "mixed") == (2, 2, 12)
    assert bytes_per_param("sgd", "fp32") == (4, 4, 0)
    assert bytes_per_param("sgd_momentum", "fp32") == (4, 4, 4)
    assert bytes_per_param("sgd_momentum", "bf16") == (2, 2, 8)
    mixed = estimate_memory(1e9, 4, "zero1", precision="mixed").per_rank_bytes
    for synonym in ("bf16", "fp16"):
        assert estimate_memory(1e9, 4, "zero1", precision=synonym).per_rank_bytes == mixed


@pytest.mark.parametrize("params,dp", [(1e9, 2), (7.5e9, 64), (123_456, 3)])
@pytest.mark.parametrize("precision,p,g,k", [("fp32", 4, 4, 8), ("mixed", 2, 2, 12)])
def test_zero_stage_formulas(params, dp, precision, p, g, k):
    def get(strategy):
        return estimate_memory(params, dp, strategy, precision=precision).per_rank_bytes

    assert get("ddp") == pytest.approx(
        {
            "params": p * params,
            "grads": g * params,
            "optim": k * params,
            "total": (p + g + k) * params,
        }
    )
    assert get("zero1")["optim"] == pytest.approx(k * params / dp)
    assert get("zero1")["grads"] == pytest.approx(g * params)
    assert get("zero2")["grads"] == pytest.approx(g * params / dp)
    assert get("zero2")["params"] == pytest.approx(p * params)
    assert get("zero3") == pytest.approx(
        {
            "params": p * params / dp,
            "grads": g * params / dp,
            "optim": k * params / dp,
            "total": (p + g + k) * params / dp,
        }
    )


def test_degree_defaults_follow_the_cli():
    assert (estimate_memory(1e9, 8, "ddp").dp, estimate_memory(1e9, 8, "zero3").dp) == (8, 8)
    pipe = estimate_memory(1e9, 4, "pipeline")
    tens = estimate_memory(1e9, 4, "tp")
    assert (pipe.dp, pipe.tp, pipe.pp) == (1, 1, 4)
    assert (tens.dp, tens.tp, tens.pp) == (1, 4, 1)
    mixed = estimate_memory(1e9, 8, "zero3", tp=2)  # own degree takes what is left
    assert (mixed.dp, mixed.tp, mixed.pp) == (4, 2, 1)
    assert estimate_memory(1e9).dp == 1 and estimate_memory(1e9, strategy="single").dp == 1


def test_tp_and_pp_divide_the_model_states():
    one = estimate_memory(1e9, 1, "single").per_rank_bytes
    for strategy in ("tp", "pipeline"):
        got = estimate_memory(1e9, 4, strategy).per_rank_bytes
        assert got == pytest.approx({k: v / 4 for k, v in one.items()})


def test_hybrid_divides_by_model_parallel_then_replicates_over_dp():
    est = estimate_memory(8e9, 8, "hybrid", dp=2, tp=2, pp=2, precision="mixed")
    psi = 8e9 / 4
    assert est.per_rank_bytes == pytest.approx(
        {"params": 2 * psi, "grads": 2 * psi, "optim": 12 * psi, "total": 16 * psi}
    )
    assert (est.dp, est.tp, est.pp, est.zero_stage) == (2, 2, 2, 0)
    fsdp_tp = estimate_memory(8e9, 8, "zero3", dp=4, tp=2, precision="mixed")
    assert fsdp_tp.per_rank_bytes["total"] == pytest.approx(16 * 8e9 / 2 / 4)


def test_offload_splits_device_and_host():
    base = estimate_memory(1e9, 4, "zero2", precision="mixed").per_rank_bytes
    off = estimate_memory(1e9, 4, "zero2", precision="mixed", offload="optimizer").per_rank_bytes
    # the fp32 master copy and both Adam moments (12 bytes/param, sharded) live on the host
    assert off["host"] == pytest.approx(12 * 1e9 / 4) == pytest.approx(base["optim"])
    assert off["optim"] == 0 and off["params"] == base["params"] and off["grads"] == base["grads"]
    assert off["total"] == pytest.approx(base["total"] - off["host"])
    p3 = estimate_memory(1e9, 4, "zero3", precision="mixed", offload="params").per_rank_bytes
    assert p3["params"] == 0 and p3["optim"] == 0
    assert p3["host"] == pytest.approx((2 + 12) * 1e9 / 4)
    assert p3["total"] == pytest.approx(p3["grads"]) == pytest.approx(2 * 1e9 / 4)
    assert "host" not in base


def test_activation_formula_hand_computed():
    # s=8, b=2, h=16, a=4: s*b*h = 256; 16-bit: 34 + 5*a*s/h = 34 + 10 = 44 -> 11264 bytes/layer
    assert activation_bytes_per_layer(2, 8, 16, 4) == 11264
    # fp32 tensors (masks stay 1 byte): 66 + 9*a*s/h = 66 + 18 = 84
    assert activation_bytes_per_layer(2, 8, 16, 4, element_bytes=4) == 256 * 84
    # tp=2 without sequence parallelism: 10 + 24/2 + 5*a*s/(h*2) = 10 + 12 + 5 = 27
    assert activation_bytes_per_layer(2, 8, 16, 4, tp=2, sequence_parallel=False) == 256 * 27
    assert activation_bytes_per_layer(2, 8, 16, 4, tp=2) == 11264 / 2

    est = estimate_memory(1e6, precision="mixed", activations=ACT).per_rank_bytes
    assert est["activations"] == 4 * 11264
    assert est["total"] == pytest.approx(16e6 + 4 * 11264)
    staged = estimate_memory(
        1e6, 4, "hybrid", tp=2, pp=2, precision="bf16", activations=dict(ACT, in_flight=2)
    ).per_rank_bytes
    assert staged["activations"] == 2 * (11264 / 2) * 2  # 2 layers/stage, /tp, 2 in flight
    fp32 = estimate_memory(1e6, activations=ACT).per_rank_bytes
    assert fp32["activations"] == 4 * 256 * 84


def test_to_json_shape_and_serialisable():
    out = estimate_memory(13e9, 64, "zero3").to_json()
    assert set(out["per_rank_bytes"]) == {"params", "grads", "optim", "total"}
    assert out["strategy"] == "zero3" and (out["dp"], out["tp"], out["pp"]) == (64, 1, 1)
    assert json.loads(json.dumps(out)) == out
    with_act = estimate_memory(1e6, activations=ACT).to_json()
    assert set(with_act["per_rank_bytes"]) == {"params", "grads", "optim", "activations", "total"}


def test_reprs_are_cheap_and_informative():
    est = estimate_memory(13e9, 64, "zero3", precision="mixed")
    assert "zero3" in repr(est) and "3.25 GB" in repr(est)
    html = est._repr_html_()
    assert html.startswith("<table>") and html.count("<tr>") == 5 and "3.25 GB" in html
    assert isinstance(est, MemoryEstimate)
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.strategy = "ddp"  # frozen


@pytest.mark.parametrize("module", ["nbpar.estimate", "nbpar.comm_estimate", "nbpar.view.history"])
def test_import_is_light(module):
    """The estimator and the step records every figure reads import neither torch nor
    matplotlib: a kernel that only looks at runs does not pay for them."""
    code = (
        f"import sys, {module}; "
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


BAD = [
    (dict(params=0), "params"),
    (dict(params=-1), "params"),
    (dict(params=math.nan), "params"),
    (dict(params="1e9"), "params"),
    (dict(params=True), "params"),
    (dict(params=1e9, world_size=0), "world_size"),
    (dict(params=1e9, world_size=2.0), "world_size"),
    (dict(params=1e9, world_size=4, dp=1.5), "dp"),
    (dict(params=1e9, world_size=4, tp=0), "tp"),
    (dict(params=1e9, world_size=4, strategy="zero3", tp=3), "divisible"),
    (dict(params=1e9, world_size=4, strategy="hybrid"), "hybrid"),
    (dict(params=1e9, world_size=4, strategy="hybrid", dp=2, tp=1), "must equal"),
    (dict(params=1e9, world_size=4, dp=2, tp=2, pp=2), "must equal"),
    (dict(params=1e9, world_size=2, strategy="single"), "single"),
    (dict(params=1e9, strategy="zero4"), "strategy"),
    (dict(params=1e9, optimizer="adafactor"), "optimizer"),
    (dict(params=1e9, precision="fp8"), "precision"),
    (dict(params=1e9, offload="nvme"), "offload"),
    (dict(params=1e9, world_size=2, strategy="zero2", offload="params"), "needs strategy zero3"),
    (dict(params=1e9, world_size=2, strategy="ddp", offload="optimizer"), "zero1 or zero2"),
    (dict(params=1e9, activations=dict(batch=1)), "activations"),
    (dict(params=1e9, activations=dict(ACT, hidden=0)), "hidden"),
    (dict(params=1e9, activations=dict(ACT, dropout=0.1)), "unknown"),
    (dict(params=1e9, world_size=8, strategy="pipeline", activations=ACT), "layers"),
]


@pytest.mark.parametrize("kwargs,word", BAD)
def test_bad_input_raises_value_error(kwargs, word):
    with pytest.raises(ValueError, match=word):
        estimate_memory(**kwargs)


def test_bad_zero_table_and_compare_input():
    with pytest.raises(ValueError, match="world_size"):
        zero_table(1e9, 0)
    est = estimate_memory(1e9)
    with pytest.raises(ValueError, match="measured"):
        est.compare({"peak_bytes": 1})
    with pytest.raises(ValueError, match="grad_bytes"):
        est.compare({"grad_bytes": -1})


def test_compare_math():
    est = estimate_memory(1000, 2, "zero1")  # params 4000, grads 4000, optim 8000/2
    got = est.compare({"rank": 0, "param_bytes": 4400, "grad_bytes": 3000, "optim_bytes": 4000})
    assert got["params"] == {"measured": 4400, "estimated": 4000, "rel_error": pytest.approx(0.1)}
    assert got["grads"]["rel_error"] == pytest.approx(-0.25)
    assert got["optim"]["rel_error"] == 0
    sgd = estimate_memory(1000, optimizer="sgd")
    assert sgd.compare({"optim_bytes": 0})["optim"]["rel_error"] == 0
    assert sgd.compare({"optim_bytes": 8})["optim"]["rel_error"] == math.inf
    assert set(sgd.compare({"param_bytes": 1})) == {"params"}


def test_plot_bars_equal_the_numbers():
    from matplotlib.figure import Figure

    est = estimate_memory(
        1e9,
        4,
        "zero2",
        precision="mixed",
        offload="optimizer",
        activations=dict(batch=4, seq_len=1024, hidden=2048, layers=8, heads=16),
    )
    fig = est.plot()
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    parts = [est.per_rank_bytes[k] / GB for k in ("params", "grads", "optim", "activations")]
    assert heights == pytest.approx(parts + [est.per_rank_bytes["host"] / GB])
    device = [p for p in ax.patches if p.get_x() < 0.5]
    assert sum(p.get_height() for p in device) == pytest.approx(est.per_rank_bytes["total"] / GB)
    assert [p.get_y() for p in device] == pytest.approx(
        [0, parts[0], sum(parts[:2]), sum(parts[:3])]
    )
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot
    other = Figure().add_subplot()
    assert est.plot(ax=other) is other.figure


def test_backend_models_what_implementations_hold_between_steps():
    from nbpar.estimate import estimate_memory

    P, N = 1e6, 2
    paper = estimate_memory(P, N, "zero2").per_rank_bytes
    fsdp = estimate_memory(P, N, "zero2", backend="torch").per_rank_bytes
    assert paper["params"] == 4 * P and fsdp["params"] == 4 * P / N  # FSDP2 reshards
    assert fsdp["grads"] == paper["grads"] and fsdp["optim"] == paper["optim"]
    ds1 = estimate_memory(P, N, "zero1", backend="deepspeed").per_rank_bytes
    assert ds1["grads"] == 4 * P / N  # reduced into this rank's partition
    assert ds1["optim"] == (8 + 4) * P / N  # Adam states + fp32 master partition
    assert (
        estimate_memory(P, N, "ddp", backend="deepspeed").per_rank_bytes
        == estimate_memory(P, N, "ddp").per_rank_bytes
    )
    mixed = estimate_memory(P, N, "zero1", precision="mixed", backend="deepspeed")
    assert mixed.per_rank_bytes["optim"] == 12 * P / N  # master already in K=12
    with pytest.raises(ValueError, match="backend must be"):
        estimate_memory(P, N, "zero1", backend="jax")


def test_tensor_parallel_estimate_counts_what_the_plan_leaves_whole():
    import nbpar
    from nbpar.estimate import estimate_memory
    from nbpar.model.models import build_model
    from nbpar.model.plan import tp_replicated_parameters

    model = build_model(nbpar.TrainConfig())
    n = sum(p.numel() for p in model.parameters())
    whole = tp_replicated_parameters(model)
    g = nbpar.GPTConfig()
    blocks = g.n_layers * (
        4 * g.d_model * g.d_model
        + 3 * g.d_model  # q, k, v, out (+qkv bias)
        + 2 * g.ffn_mult * g.d_model * g.d_model
        + g.ffn_mult * g.d_model
    )
    ends = 2 * g.vocab_size * g.d_model  # the embedding by rows, the head by columns
    # only the blocks' split weights (and colwise biases) and the two ends shard
    assert n - whole == blocks + ends
    est = estimate_memory(n, 2, "tp", tp_replicated=whole)
    assert est.per_rank_bytes["params"] == 4 * ((n - whole) / 2 + whole)
    assert estimate_memory(n, 2, "tp").per_rank_bytes["params"] == 4 * n / 2  # the paper's
    with pytest.raises(ValueError, match="tp_replicated"):
        estimate_memory(n, 2, "tp", tp_replicated=n + 1)


def test_activation_recomputation_keeps_only_layer_inputs():
    from nbpar.estimate import activation_bytes_per_layer, estimate_memory

    spec = dict(batch=1, seq_len=2048, hidden=12288, layers=96, heads=96)
    full = estimate_memory(175e9, 8, "tp", tp=8, precision="mixed", activations=spec)
    rec = estimate_memory(
        175e9, 8, "tp", tp=8, precision="mixed", activations={**spec, "recompute": True}
    )
    per_layer = activation_bytes_per_layer(1, 2048, 12288, 96, tp=8)
    layer_input = 2048 * 12288 * 2 / 8  # 16-bit, split over t by sequence parallelism
    assert full.per_rank_bytes["activations"] == pytest.approx(96 * per_layer)
    assert rec.per_rank_bytes["activations"] == pytest.approx(96 * layer_input + per_layer)
    no_sp = estimate_memory(
        175e9,
        8,
        "tp",
        tp=8,
        precision="mixed",
        activations={**spec, "recompute": True, "sequence_parallel": False},
    )
    assert no_sp.per_rank_bytes["activations"] > rec.per_rank_bytes["activations"]
