"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) against one process.

Every schedule must give, step by step, the loss of single-process training
of the full model on the same global batch with gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch

from nbpar.measure.clocks import clock_offset, cristian_offset
from nbpar.measure.timeline import (
    SETUP_STEPS,
    bubble_fraction,
    plot_timeline,
    schedule_bubble,
    theory_bubble,
)
from nbpar.model.models import next_token_loss as lm_loss
from nbpar.parallel import ds_pipeline, pipeline, pipeline_cut
from tests.distributed import run_distributed
from tests.reference.gpt import (
    ACCUM,
    MICRO,
    STEPS,
    batches,
    build_mesh,
    make_cfg,
    make_model,
    single_losses,
)


def _train_schedules(rank, world):
    mesh = build_mesh(world, pp=world)
    out = {}
    for schedule in ("gpipe", "1f1b", "interleaved"):
        runner = pipeline.build_runner(
            make_model(), make_cfg(schedule=schedule), mesh, loss_fn=lm_loss
        )
        with pytest.raises(ValueError, match="expected 4 micro-batches"):
            runner.train_step(batches(0)[:2])
        losses, keys_ok = [], True
        for s in range(STEPS):
            losses.append(runner.train_step(batches(s)).item())
            keys = sorted((e["stage"], e["microbatch"], e["kind"]) for e in runner.timeline())
            n_stages = world * (2 if schedule == "interleaved" else 1)
            keys_ok &= keys == sorted(
                (st, mb, k) for st in range(n_stages) for mb in range(ACCUM) for k in "FB"
            )
        out[schedule] = dict(
            losses=losses,
            keys_ok=keys_ok,
            timeline=runner.timeline(),
            bubble=runner.bubble_fraction(),
            with_stalls=runner.bubble_fraction_with_stalls(),
        )
    runner = pipeline.build_runner(make_model(), make_cfg(precision="bf16"), mesh, loss_fn=lm_loss)
    out["bf16"] = [runner.train_step(batches(s)).item() for s in range(3)]
    return out


@pytest.fixture(scope="module")
def pp2_results():
    return run_distributed(_train_schedules, 2, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pp2_schedule_matches_single_process(pp2_results, schedule):
    ref = torch.tensor(single_losses())
    for rank_out in pp2_results:
        got = torch.tensor(rank_out[schedule]["losses"])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.timeout(240)
def test_pp2_bf16_autocast_stays_close_to_fp32(pp2_results):
    bf16 = torch.tensor(pp2_results[0]["bf16"])
    torch.testing.assert_close(bf16, torch.tensor(single_losses(3)), atol=3e-2, rtol=0)
    assert not torch.equal(bf16, torch.tensor(single_losses(3)))  # autocast really ran


def _union_s(intervals) -> float:
    """Seconds covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        a = max(a, end)
        if b > a:
            total, end = total + b - a, b
    return total


def _idle_by_hand(events, p, *, leave_out_stalls=True) -> float:
    """1 - busy / (p x span), counted from the boxes: a rank's busy seconds are the union
    of its boxes; leaving stalls out, each stall's seconds past its typical length are
    taken out of the span and out of every rank's busy time they cover."""
    stalls = [e for e in events if e.get("stall")] if leave_out_stalls else []
    cuts = [(e["start"] + e["typical_s"], e["end"]) for e in stalls]

    def busy(boxes) -> float:
        covered = [(max(a, c), min(b, d)) for a, b in boxes for c, d in cuts]
        return _union_s(boxes) - _union_s([(a, b) for a, b in covered if b > a])

    span = max(e["end"] for e in events) - min(e["start"] for e in events) - _union_s(cuts)
    ranks = {e["rank"] for e in events}
    total = sum(busy([(e["start"], e["end"]) for e in events if e["rank"] == r]) for r in ranks)
    return 1 - total / (p * span)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_timeline_is_complete_and_causal(pp2_results, schedule):
    res = pp2_results[0][schedule]
    assert res["keys_ok"], "a (stage, microbatch, kind) was missing or repeated in a step"
    assert pp2_results[1][schedule]["timeline"] == res["timeline"]  # gathered everywhere
    span = {(e["stage"], e["microbatch"], e["kind"]): e for e in res["timeline"]}
    n_stages = 4 if schedule == "interleaved" else 2
    for mb in range(ACCUM):
        for st in range(1, n_stages):
            assert span[(st, mb, "F")]["start"] >= span[(st - 1, mb, "F")]["end"]
            assert span[(st - 1, mb, "B")]["start"] >= span[(st, mb, "B")]["end"]
    # a schedule cannot idle less than its theory (equal stages); this tiny model's
    # overheads make it idle more, never less
    m, v = ACCUM, 2 if schedule == "interleaved" else 1
    assert theory_bubble(2, m, v=v) - 0.02 <= res["bubble"] < 1.0
    # the runner's bubbles are what each rank's boxes leave idle in the step, counted here
    # from the gathered timeline on its own (stage s runs on rank s % 2)
    assert {e["rank"] for e in res["timeline"] if e["stage"] % 2 == 1} == {1}
    assert res["bubble"] == pytest.approx(_idle_by_hand(res["timeline"], 2))
    no_cut = _idle_by_hand(res["timeline"], 2, leave_out_stalls=False)
    assert res["with_stalls"] == pytest.approx(no_cut)
    fig = plot_timeline(res["timeline"])
    assert len(fig.axes[0].patches) == len(res["timeline"])


def test_theory_bubble_and_measured_bubble():
    assert theory_bubble(2, 4) == pytest.approx(0.2)
    assert theory_bubble(4, 4) == pytest.approx(3 / 7)
    assert theory_bubble(1, 8) == 0.0
    events = [
        dict(stage=0, microbatch=0, kind="F", start=0.0, end=1.0),
        dict(stage=1, microbatch=0, kind="F", start=1.0, end=2.0),
    ]
    assert bubble_fraction(events, 2) == pytest.approx(0.5)
    assert theory_bubble(2, 4, v=2) == pytest.approx(1 / 9)
    with pytest.raises(ValueError, match="p, m and v"):
        theory_bubble(0, 4)


def _gpipe_events(p: int, m: int, f: list[float], b: list[float], gap: float = 0.0):
    """A GPipe step with stage s's F lasting f[s] and B b[s], ``gap`` between dependent
    boxes on different stages (send/recv), as TimedStage records it."""
    done, events = {}, []
    free = [0.0] * p
    for mb in range(m):
        for s in range(p):
            start = max(free[s], done.get(("F", s - 1, mb), -gap) + gap)
            done[("F", s, mb)] = free[s] = start + f[s]
            events.append(dict(stage=s, rank=s, microbatch=mb, kind="F", start=start, end=free[s]))
    for mb in range(m):
        for s in reversed(range(p)):
            dep = done[("F", s, mb)] if s == p - 1 else done[("B", s + 1, mb)] + gap
            start = max(free[s], dep)
            done[("B", s, mb)] = free[s] = start + b[s]
            events.append(dict(stage=s, rank=s, microbatch=mb, kind="B", start=start, end=free[s]))
    return events


def test_schedule_bubble_replays_the_measured_boxes():
    for m in (1, 2, 4, 8):  # equal stages, no gaps: the formula exactly
        events = _gpipe_events(2, m, [1.0, 1.0], [2.0, 2.0])
        assert schedule_bubble(events, 2) == pytest.approx(theory_bubble(2, m))
        assert bubble_fraction(events, 2) == pytest.approx(theory_bubble(2, m))
    gaps = _gpipe_events(2, 4, [1.0, 1.0], [2.0, 2.0], gap=0.5)  # send/recv takes time
    assert bubble_fraction(gaps, 2) > schedule_bubble(gaps, 2) == pytest.approx(0.2)
    # unequal stages: stage 0 runs F 0-4 and its B 13-15, 17-19, 21-23, 25-27 (12 s busy),
    # stage 1 F 1-9 and B 9-25 (24 s), so 1 - 36 / (2 x 27) idle
    slow_last = _gpipe_events(2, 4, [1.0, 2.0], [2.0, 4.0])
    assert bubble_fraction(slow_last, 2) == pytest.approx(1 / 3)
    assert schedule_bubble(slow_last, 2) == pytest.approx(1 / 3)  # no gaps: the same step
    with pytest.raises(ValueError, match="cannot be replayed"):
        schedule_bubble(
            [
                dict(stage=0, rank=0, microbatch=0, kind="B", start=0, end=1),
                dict(stage=1, rank=1, microbatch=1, kind="F", start=0, end=1),
            ],
            2,
        )


def _metered_run(rank, world, schedule, m):
    """run_training over 8 steps of a 2-stage pipeline (the loop meters the third): the
    run's result and the runner's typical step."""
    from nbpar.train.loop import run_training

    seen = {}

    def keep(runner):
        seen.update(
            about=runner.timelines.about(),
            timeline=runner.timeline(),
            bubble=runner.bubble_fraction(),
            with_stalls=runner.bubble_fraction_with_stalls(),
            forced=runner.schedule_bubble_fraction(),
        )

    res = run_training(make_cfg(schedule=schedule, grad_accum=m, steps=8), on_finish=keep)
    metered = [r["step"] for r in res.pop("history") if r.get("comm_metered")]
    return dict(seen, result=res, metered=metered)


@pytest.fixture(scope="module")
def metered_runs():
    return {
        (schedule, m): run_distributed(_metered_run, 2, schedule, m, timeout=200)
        for schedule, m in (("gpipe", 4), ("1f1b", 8))
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("1f1b", 8)])
def test_run_timeline_is_a_normal_step_not_the_metered_one(metered_runs, schedule, m):
    ranks = metered_runs[(schedule, m)]
    about, metered = ranks[0]["about"], ranks[0]["metered"]
    assert metered == [2]  # the loop's meter ran on the third step ...
    assert about["metered"] == metered  # ... and the runner saw which one it was
    # the drawn step is the median of the 5 normal steps after the set-up and the meter
    assert about["step"] not in metered and about["step"] >= SETUP_STEPS
    assert about["normal_steps"] == 5 and about["typical"]
    keys = sorted((e["stage"], e["microbatch"], e["kind"]) for e in ranks[0]["timeline"])
    assert keys == sorted((s, mb, k) for s in (0, 1) for mb in range(m) for k in "FB")
    assert ranks[1]["timeline"] == ranks[0]["timeline"]  # both ranks pick the same step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("1f1b", 8)])
def test_run_bubble_leaves_stalls_out_and_reports_both(metered_runs, schedule, m):
    """Correctness, not timing (a box another process slowed is a stall, not a failure):
    the run reports the runner's typical step, whose bubbles count what its boxes leave
    idle, with and without its stalls; the schedule's part stays a lower bound."""
    for res in metered_runs[(schedule, m)]:
        timeline = res["timeline"]
        assert all(isinstance(e["stall"], bool) for e in timeline)
        assert res["result"]["bubble_fraction"] == res["bubble"]
        assert res["result"]["schedule_bubble_fraction"] == res["forced"]
        assert res["bubble"] == pytest.approx(_idle_by_hand(timeline, 2))
        no_cut = _idle_by_hand(timeline, 2, leave_out_stalls=False)
        assert res["with_stalls"] == pytest.approx(no_cut)
        if res["about"]["stalls"] == 0:
            assert res["with_stalls"] == res["bubble"]
        assert 0.0 <= res["forced"] <= res["bubble"] + 1e-9 < 1.0


def test_split_stages_partitions_the_model():
    model = make_model()
    full = dict(model.named_parameters())
    for pp, virtual in ((2, 1), (2, 2), (4, 1), (3, 1)):
        seen = {}
        for r in range(pp):
            for chunk in pipeline.split_stages(model, r, pp, virtual):
                for name, p in chunk.named_parameters():
                    assert name not in seen, f"{name} on two stages"
                    seen[name] = p
        assert set(seen) == set(full)
        for name, p in seen.items():
            torch.testing.assert_close(p, full[name])
    (first,) = pipeline.split_stages(model, 0, 2)
    (last,) = pipeline.split_stages(model, 1, 2)
    assert first.head is None and first.tok_emb is not None and list(first.layers) == ["0", "1"]
    assert last.tok_emb is None and last.head is not None and list(last.layers) == ["2", "3"]
    assert [list(c.layers) for c in pipeline.split_stages(model, 1, 2, virtual=2)] == [["1"], ["3"]]
    assert [len(r) for r in pipeline_cut.layer_ranges(5, 3)] == [2, 2, 1]


def test_split_and_schedule_reject_bad_input():
    model = make_model()
    with pytest.raises(ValueError, match="4 layers"):
        pipeline.split_stages(model, 0, 5)
    with pytest.raises(ValueError, match="stages"):
        pipeline.split_stages(model, 0, 3, virtual=2)
    with pytest.raises(ValueError, match="schedule='zigzag' is not supported"):
        pipeline.validate(make_cfg(schedule="zigzag"), 2, 4)
    with pytest.raises(ValueError, match="grad_accum=1"):
        pipeline.validate(make_cfg(schedule="interleaved", grad_accum=1), 2, 4)
    with pytest.raises(ValueError, match="needs 8 layers, gpt.n_layers=4"):
        pipeline.validate(make_cfg(schedule="interleaved"), 4, 4)
    assert pipeline.validate(make_cfg(schedule="interleaved"), 2, 4) == 2


def _train_deepspeed(rank, world):
    mesh = build_mesh(world, pp=world)
    runner = ds_pipeline.build_runner(
        make_model(), make_cfg(backend="deepspeed"), mesh, loss_fn=lm_loss
    )
    with pytest.raises(ValueError, match="micro-batches"):
        runner.train_step(batches(0)[:2])
    losses = [runner.train_step(batches(s)).item() for s in range(STEPS)]
    return losses, runner.timeline(), runner.bubble_fraction()


@pytest.mark.timeout(240)
def test_deepspeed_pipeline_pp2_matches_single_process():
    """DeepSpeed's 1F1B equals the single-process reference, and its passes are timed
    as torch's pipeline's are: every (stage, micro-batch, pass) once in the typical
    step, in causal order, gathered on both ranks, idling no less than 1F1B's theory."""
    ref = torch.tensor(single_losses())
    results = run_distributed(_train_deepspeed, 2, timeout=230)
    for losses, _, _ in results:
        torch.testing.assert_close(torch.tensor(losses), ref, atol=1e-5, rtol=0)
    (_, events, bubble), (_, other, _) = results
    assert events and other == events
    span = {(e["stage"], e["microbatch"], e["kind"]): e for e in events}
    assert sorted(span) == sorted((st, mb, k) for st in (0, 1) for mb in range(ACCUM) for k in "FB")
    assert len(events) == len(span) and {e["rank"] for e in events if e["stage"] == 1} == {1}
    for mb in range(ACCUM):
        assert span[(1, mb, "F")]["start"] >= span[(0, mb, "F")]["end"]
        assert span[(0, mb, "B")]["start"] >= span[(1, mb, "B")]["end"]
    assert theory_bubble(2, ACCUM) - 0.02 <= bubble < 1.0


def test_deepspeed_pipeline_rejects_zero2_and_3():
    for stage in (2, 3):
        cfg = make_cfg(
            backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": stage}}
        )
        with pytest.raises(ValueError, match=f"ZeRO stage 0 or 1 only \\(got stage {stage}\\)"):
            ds_pipeline.ds_config(cfg, dp=1)
    cfg = make_cfg(backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": 1}})
    config = ds_pipeline.ds_config(cfg, dp=2)
    assert config["zero_optimization"]["stage"] == 1
    assert config["train_batch_size"] == MICRO * ACCUM * 2
    assert config["gradient_accumulation_steps"] == ACCUM


def _clock_offsets(rank, world):
    return clock_offset(), cristian_offset(rounds=16)


@pytest.mark.timeout(120)
def test_clock_offsets_within_half_round_trip():
    # one machine: clocks are shared, so the true offset is 0 and Cristian's
    # estimate may miss it by at most half its best round trip
    results = run_distributed(_clock_offsets, 3)
    assert [same for same, _ in results] == [0.0, 0.0, 0.0]
    assert results[0][1] == (0.0, 0.0)
    for _, (offset, rtt) in results[1:]:
        assert 0 < rtt < 1.0
        assert abs(offset) <= rtt / 2 + 1e-6
