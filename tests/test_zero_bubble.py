"""The zero-bubble V schedules (ZB-V, Qi et al. 2023; DualPipeV, DeepSeek-V3 2024) against
one process, alone and inside hybrid, and their timelines: F, I and W boxes apart, the
replayed bubble below 1F1B's with the same boxes, the formulas in time.

torch's ScheduleZBVZeroBubble and ScheduleDualPipeV run here on real gloo processes;
rank r holds stages r and 2p-1-r, so the loss is computed on pp rank 0.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from nbpar.config import GPTConfig, TrainConfig
from nbpar.errors import ConfigError
from nbpar.measure.bubble_formulas import formula_bubbles
from nbpar.measure.timeline import (
    COLORS,
    plot_timeline,
    schedule_bubble,
    theory_bubble,
)
from nbpar.parallel import pipeline, pipeline_cut
from nbpar.simulate.stages import schedule_order
from nbpar.strategies import check_pipeline_schedule
from tests.distributed import run_distributed
from tests.reference.gpt import (
    MICRO,
    SIZES,
    batches,
    build_mesh,
    lm_loss,
    make_cfg,
    make_model,
    reference_run,
    single_losses,
)
from tests.test_hybrid import _train_hybrid, check_against_single

STEPS = 20


def _cfg(schedule: str, m: int, layers: int, **kw) -> TrainConfig:
    return make_cfg(
        schedule=schedule, grad_accum=m, gpt=GPTConfig(**{**SIZES, "n_layers": layers}), **kw
    )


def _train_v(rank, world, runs, steps):
    """Train each (schedule, m, layers) on a pp = world pipeline; per schedule: the losses,
    the typical step's timeline and the runner's figures."""
    mesh = build_mesh(world, pp=world)
    out = {}
    for schedule, m, layers in runs:
        runner = pipeline.build_runner(
            make_model(n_layers=layers), _cfg(schedule, m, layers), mesh, loss_fn=lm_loss
        )
        losses = [runner.train_step(batches(s, m)).item() for s in range(steps)]
        out[schedule] = dict(
            losses=losses,
            timeline=runner.timeline(),
            bubble=runner.bubble_fraction(),
            replayed=runner.schedule_bubble_fraction(),
            formulas=runner.formula_bubbles(),
            peak=runner.peak_activation_bytes(),
            live=runner.activations.live_bytes(),
        )
    return out


def _train_v_and_run(rank, world, runs, steps):
    """`_train_v`, then a zbv run through the engine loop (its third step metered): the
    run's bubbles and its runner's, under "run"."""
    from nbpar.train.loop import run_training

    out, seen = _train_v(rank, world, runs, steps), {}

    def keep(runner):
        seen.update(bubble=runner.bubble_fraction(), replayed=runner.schedule_bubble_fraction())

    res = run_training(make_cfg(schedule="zbv", steps=6), on_finish=keep)
    out["run"] = {k: res[k] for k in ("bubble_fraction", "schedule_bubble_fraction")} | seen
    return out


@pytest.fixture(scope="module")
def pp2():
    runs = [("zbv", 4, 4), ("dualpipev", 4, 4)]
    return run_distributed(_train_v_and_run, 2, runs, STEPS, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_pp2_matches_single_over_20_steps(pp2, schedule):
    ref = torch.tensor(single_losses())
    for rank in pp2:
        torch.testing.assert_close(torch.tensor(rank[schedule]["losses"]), ref, atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
def test_pp4_matches_single_over_20_steps():
    """Eight one-layer stages on four ranks; DualPipeV needs a micro-batch per stage,
    and zbv takes as many (one reference run for both)."""
    runs = [("zbv", 8, 8), ("dualpipev", 8, 8)]
    ranks = run_distributed(_train_v, 4, runs, STEPS, timeout=280)
    ref = torch.tensor(reference_run(STEPS, 8, MICRO, n_layers=8)[0])
    for schedule, _, _ in runs:
        for rank in ranks:
            got = torch.tensor(rank[schedule]["losses"])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=schedule)
        keys = {(e["stage"], e["kind"]) for e in ranks[0][schedule]["timeline"]}
        assert {s for s, _ in keys} == set(range(8))


@pytest.mark.timeout(300)
def test_hybrid_dp2_pp2_matches_single_over_20_steps():
    """zbv on FSDP2 stages that reshard after forward (ZeRO-3): torch's split backward
    needs the stage's gathered parameters at its I and W passes; dualpipev on replicas
    that all-reduce their gradients."""
    dims = dict(dp=2, pp=2)
    variants = [dict(schedule="zbv", fsdp_reshard=True), dict(schedule="dualpipev")]
    results = run_distributed(_train_hybrid, 4, dims, variants, STEPS, timeout=280)
    check_against_single(results, dims, STEPS)


@pytest.mark.timeout(300)
def test_hybrid_pp2_tp2_matches_single_over_20_steps():
    dims = dict(pp=2, tp=2)
    variants = [dict(schedule="zbv"), dict(schedule="dualpipev")]
    results = run_distributed(_train_hybrid, 4, dims, variants, STEPS, timeout=280)
    check_against_single(results, dims, STEPS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_timeline_holds_f_i_w_for_every_microbatch_and_stage(pp2, schedule):
    res = pp2[0][schedule]
    assert pp2[1][schedule]["timeline"] == res["timeline"]  # gathered everywhere
    boxes = {(e["stage"], e["microbatch"], e["kind"]): e for e in res["timeline"]}
    assert len(boxes) == len(res["timeline"])  # no pass twice
    # the V: stages 0 and 3 on pp rank 0, 1 and 2 on pp rank 1
    assert {(e["stage"], e["rank"]) for e in res["timeline"]} == {(0, 0), (3, 0), (1, 1), (2, 1)}
    for st in range(4):
        for mb in range(4):
            assert (st, mb, "F") in boxes
            split = (st, mb, "I") in boxes
            # every backward ran once: split in I and W, or (DualPipeV) whole as B
            assert split == ((st, mb, "W") in boxes)
            assert split != ((st, mb, "B") in boxes)
            grad = boxes[(st, mb, "I" if split else "B")]
            if split:
                assert boxes[(st, mb, "W")]["start"] >= grad["end"]
            if st > 0:
                assert boxes[(st, mb, "F")]["start"] >= boxes[(st - 1, mb, "F")]["end"]
            if st < 3:
                above = boxes.get((st + 1, mb, "I")) or boxes[(st + 1, mb, "B")]
                assert grad["start"] >= above["end"]
    kinds = {e["kind"] for e in res["timeline"]}
    assert kinds == ({"F", "I", "W"} if schedule == "zbv" else {"F", "I", "W", "B"})
    # every pass counts as work: the replay is a lower bound of the measured idle share
    assert 0.0 < res["replayed"] <= res["bubble"] + 1e-9 < 1.0
    assert res["live"] == 0 and res["peak"] > 0  # each W released its micro-batch


def _mean_boxes(events):
    """Each box as long as the mean of its stage and kind in ``events`` (stalls too):
    the step's order with its measured box lengths, free of one box's noise."""
    lengths = {}
    for e in events:
        lengths.setdefault((e["stage"], e["kind"]), []).append(e["end"] - e["start"])
    mean = {k: statistics.fmean(v) for k, v in lengths.items()}
    out, t = [], 0.0
    for e in sorted(events, key=lambda e: e["start"]):
        d = mean[(e["stage"], e["kind"])]
        out.append(dict(e, start=t, end=t + d, stall=False))
        t += d
    return out


def _one_f_one_b(events, p, m):
    """The same model under 1F1B: rank r runs the V's stages r and 2p-1-r as one stage,
    its F the sum of theirs and its B the sum of their I, W and B, in 1F1B's order."""
    mean = {}
    for e in events:
        mean.setdefault((e["stage"], e["kind"]), []).append(e["end"] - e["start"])
    mean = {k: statistics.fmean(v) for k, v in mean.items()}

    def length(r, kinds):
        return sum(mean.get((s, k), 0.0) for s in (r, 2 * p - 1 - r) for k in kinds)

    out = []
    for r in range(p):
        t = 0.0
        for kind, mb in schedule_order("1f1b", r, p, m):
            d = length(r, "F" if kind == "F" else "IWB")
            out.append(dict(stage=r, rank=r, microbatch=mb, kind=kind, start=t, end=t + d))
            t += d
    return out


@pytest.mark.timeout(300)
def test_zbv_replayed_bubble_is_below_1f1b_with_the_same_boxes(pp2):
    """Load-independent: both replays take this run's measured box lengths (each box the
    mean of its stage and kind), ZB-V in the order the ranks ran it, 1F1B in its own."""
    events = pp2[0]["zbv"]["timeline"]
    zbv = schedule_bubble(_mean_boxes(events), 2)
    one_f_one_b = schedule_bubble(_one_f_one_b(events, 2, 4), 2)
    assert zbv < one_f_one_b
    # equal stages would make 1F1B's replay its theory; here it is the same model's
    assert one_f_one_b >= theory_bubble(2, 4) - 0.05
    formulas = pp2[0]["zbv"]["formulas"]
    assert formulas["1f1b"] == pytest.approx(theory_bubble(2, 4))  # (p-1)/(m+p-1) in time
    assert 0.0 <= formulas["zb_h1"] < formulas["1f1b"]


@pytest.mark.timeout(300)
def test_zbv_run_reports_the_bubbles_other_schedules_report(pp2):
    for rank in pp2:
        res = rank["run"]
        assert res["bubble_fraction"] == res["bubble"] is not None
        assert res["schedule_bubble_fraction"] == res["replayed"] is not None
        assert 0.0 <= res["schedule_bubble_fraction"] <= res["bubble_fraction"] + 1e-9 < 1.0


def test_v_placement_is_torchs():
    for p in (1, 2, 3, 4):
        torch_v = generate_stage_to_rank_mapping(p, 2 * p, style="v")
        ours = {s: r for r in range(p) for s in pipeline_cut.stage_ids(r, p, 2, style="v")}
        assert ours == torch_v
    assert pipeline_cut.stage_style("zbv") == pipeline_cut.stage_style("dualpipev") == "v"
    assert pipeline_cut.stage_style("interleaved") == "loop"
    with pytest.raises(ValueError, match="2 stages per rank"):
        pipeline_cut.stage_ids(0, 2, 3, style="v")
    model = make_model()
    first, last = pipeline.split_stages(model, 0, 2, 2, style="v")
    assert list(first.layers) == ["0"] and first.tok_emb is not None and first.head is None
    assert list(last.layers) == ["3"] and last.head is not None and last.tok_emb is None
    middle = pipeline.split_stages(model, 1, 2, 2, style="v")
    assert [list(c.layers) for c in middle] == [["1"], ["2"]]


def test_zero_bubble_schedule_rules():
    assert check_pipeline_schedule("zbv", 2, 1, 4) == 2  # torch leaves missing slots empty
    assert check_pipeline_schedule("dualpipev", 2, 4, 4) == 2
    with pytest.raises(ConfigError, match=r"'dualpipev' needs .* 2 x pp = 4 \(grad_accum=3\)"):
        check_pipeline_schedule("dualpipev", 2, 3, 4)
    with pytest.raises(ConfigError, match="'zbv' with pp=2 needs 4 layers, gpt.n_layers=3"):
        check_pipeline_schedule("zbv", 2, 4, 3)
    four = GPTConfig(n_layers=4)
    with pytest.raises(ConfigError) as err:
        TrainConfig(strategy="pipeline", schedule="dualpipev", grad_accum=2, gpt=four).validate(2)
    assert err.value.field == "grad_accum" and "pp" in err.value.fields
    with pytest.raises(ConfigError, match="backend 'torch'"):
        TrainConfig(strategy="pipeline", schedule="zbv", backend="deepspeed", gpt=four).validate(2)
    TrainConfig(strategy="pipeline", schedule="zbv", grad_accum=1, gpt=four).validate(2)


def test_simulate_refuses_the_v_schedules_in_one_line():
    from nbpar.simulate.runners import check_simulable

    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ValueError, match=f"schedule '{schedule}' is not simulated"):
            check_simulable(make_cfg(schedule=schedule))
    check_simulable(make_cfg(schedule="1f1b"))


def _box(stage, mb, kind, start, end):
    return dict(stage=stage, rank=stage, microbatch=mb, kind=kind, start=start, end=end)


def test_replay_waits_for_the_input_gradient_not_the_weight_gradient():
    # stage 1 (last) runs F, I, W; stage 0 runs F, then its I needs stage 1's I only:
    # the W of stage 1 (2 s) overlaps stage 0's I instead of delaying it
    events = [
        _box(0, 0, "F", 0, 1),
        _box(1, 0, "F", 1, 2),
        _box(1, 0, "I", 2, 3),
        _box(1, 0, "W", 3, 5),
        _box(0, 0, "I", 3, 4),
        _box(0, 0, "W", 4, 5),
    ]
    # makespan 5 s, busy 1+1+1+1 + 1+2 = 7 s of 2 x 5
    assert schedule_bubble(events, 2) == pytest.approx(1 - 7 / 10)
    # the same passes with the backward whole (B = I + W): stage 1's 3 s, stage 0's 2 s
    full = [dict(e, kind="B", end=e["end"] + 1 + e["stage"]) for e in events if e["kind"] == "I"]
    full = [e for e in events if e["kind"] == "F"] + full
    # stage 0 waits for stage 1's whole backward: 1 + 1 + 3 + 2 = 7 s makespan
    assert schedule_bubble(full, 2) == pytest.approx(1 - 7 / 14)
    with pytest.raises(ValueError, match="cannot be replayed"):
        schedule_bubble([_box(0, 0, "W", 0, 1)], 1)  # a W whose I never ran


def test_formulas_from_mean_boxes():
    # one device per stage, F 1 s, I 2 s, W 1 s each: 1F1B idles (p-1)(F+I+W) = 4 s,
    # ZB-H1 (p-1)(F+I-W) = 2 s, beside m(F+I+W) = 16 s of work
    events = [
        _box(s, mb, k, 0, length)
        for s in (0, 1)
        for mb in range(4)
        for k, length in (("F", 1), ("I", 2), ("W", 1))
    ]
    f = formula_bubbles(events, 2)
    assert (f["F"], f["I"], f["W"]) == (1, 2, 1)
    assert f["1f1b_s"] == 4 and f["1f1b"] == pytest.approx(4 / 20) == theory_bubble(2, 4)
    assert f["zb_h1_s"] == 2 and f["zb_h1"] == pytest.approx(2 / 18)
    # a full backward box counts as I + W; without W boxes only 1F1B's formula applies
    whole = formula_bubbles([dict(e, kind="B", end=3) for e in events if e["kind"] == "I"], 2)
    assert whole["I"] == 3 and whole["W"] == 0 and "zb_h1" not in whole
    # the V: a device's two stages add up
    v = formula_bubbles([dict(e, rank=0) for e in events], 1)
    assert v["F"] == 2 and v["1f1b_s"] == 0
    assert formula_bubbles([], 2) is None


def test_plot_draws_each_kind_in_its_colour_with_a_legend(pp2):
    events = pp2[0]["zbv"]["timeline"]
    fig = plot_timeline(events)
    ax = fig.axes[0]
    assert len(ax.patches) == len(events)
    drawn = {tuple(round(c, 3) for c in patch.get_facecolor()[:3]) for patch in ax.patches}
    from matplotlib.colors import to_rgb

    assert drawn == {tuple(round(c, 3) for c in to_rgb(COLORS[k])) for k in "FIW"}
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:3] == ["forward (F)", "input gradient (I)", "weight gradient (W)"]
    title = ax.get_title()
    assert "replayed" in title and "1F1B (p-1)(F+I+W) 0.20" in title and "ZB-H1" in title
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0,3", "stage 1,2"]
