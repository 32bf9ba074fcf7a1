"""StrategyPicker: every strategy starts from a valid choice, controls that do not apply
are hidden, every problem is listed at once in the labels' words with advice valid on
this pool, number boxes refuse instead of changing a value, and Run cannot be pressed
twice while a run goes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

import nbpar
from nbpar import config as C
from nbpar.config import GPTConfig
from nbpar.view.dashboard import Dashboard
from nbpar.view.widgets import StrategyPicker
from tests.viz_fakes import FakeRun, history


@dataclass
class FakePool:
    n: int = 2
    finished: bool = True
    trained: list = field(default_factory=list)
    runs: list = field(default_factory=list)

    def train(self, cfg):
        self.trained.append(cfg)
        run = FakeRun(
            cfg=cfg,
            ranks=list(range(self.n)),
            history=history(cfg.steps, ranks=tuple(range(self.n)), comm=(0.01,) * self.n),
            finished=self.finished,
        )
        self.runs.append(run)
        return run


def _set(picker, **values):
    for name, value in values.items():
        picker.fields[name].value = value


def _shown(picker):
    return {k for k, w in picker.fields.items() if w.layout.display != "none"}


def test_defaults_are_valid_and_show_the_global_batch():
    picker = StrategyPicker(FakePool(2), background=False)
    assert picker.check() is None and picker.button.disabled is False
    assert picker.message == "ready: ddp/torch on 2 ranks, dp 2 × tp 1 × pp 1"
    _set(picker, micro_batch=4, grad_accum=3)
    assert picker.batch_label.value == (
        "global batch = micro-batch × grad accum × dp = 4 × 3 × 2 = 24"
    )
    _set(picker, strategy="pipeline")
    assert picker.batch_label.value.endswith("4 × 3 × 1 = 12")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_strategy_the_pool_can_run_starts_valid(n):
    picker = StrategyPicker(FakePool(n), background=False)
    for strategy in C.STRATEGIES:
        _set(picker, strategy=strategy)
        if n == 1 and strategy in ("pipeline", "tp"):  # one engine: nothing to split
            continue
        if strategy == "ep":  # tiny_gpt has no experts: explained
            assert picker.problems == [
                "expert parallelism shares out the experts of a mixture-of-experts model "
                "(a name with moe, e.g. tiny_moe), not tiny_gpt"
            ]
            continue
        if n == 4 and strategy == "pipeline":  # 4 stages, tiny_gpt has 2 layers: explained
            assert picker.problems == [
                "pp 4 pipeline stages need at least 4 layers, the model's layers 2"
            ]
            continue
        assert picker.problems == [], (strategy, picker.problems)
        assert not picker.button.disabled and picker.message.startswith(f"ready: {strategy}/")


def test_controls_that_do_not_apply_are_hidden():
    picker = StrategyPicker(FakePool(2), background=False)
    numbers = {"micro_batch", "grad_accum", "steps"}
    numbers |= {"activation_checkpointing"}  # tiny_gpt runs its blocks in order
    assert _shown(picker) == {"model", "strategy", "backend", "precision"} | numbers
    _set(picker, strategy="pipeline")
    assert _shown(picker) == {"model", "strategy", "backend", "precision", "schedule"} | numbers
    _set(picker, strategy="hybrid")
    assert {"schedule", "dp", "tp", "pp"} <= _shown(picker)
    _set(picker, strategy="zero2", backend="deepspeed")
    assert "offload" in _shown(picker) and "schedule" not in _shown(picker)
    degrees = {"dp", "tp", "pp"}
    assert not _shown(picker) & degrees  # dp, its own degree, takes all engines
    _set(picker, strategy="hybrid")  # DeepSpeed's PipelineModule: pp x dp, no tp
    assert _shown(picker) & degrees == {"dp", "pp"}
    _set(picker, strategy="zero3", backend="torch")  # FSDP over tp shards: dp takes the rest
    assert _shown(picker) & degrees == {"tp"}


def test_pipeline_to_gpipe_and_back_never_traps():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, strategy="pipeline")
    assert picker.fields["schedule"].value == "gpipe" and picker.problems == []
    _set(picker, schedule="1f1b")  # 1F1B needs a micro-batch per stage: says how out
    assert picker.message == (
        "cannot run: schedule 1f1b needs at least as many micro-batches "
        "(grad accum 1) as pipeline stages (pp 2); raise grad accum or "
        "use schedule gpipe"
    )
    _set(picker, grad_accum=2)
    assert picker.problems == []
    _set(picker, schedule="gpipe", grad_accum=1)
    for strategy in ("ddp", "zero1", "zero3", "tp"):  # the hidden schedule is not used
        _set(picker, strategy=strategy)
        assert picker.problems == [] and picker.config().schedule == C.DEFAULT_SCHEDULE


def test_hybrid_starts_from_degrees_that_fit_and_advice_that_runs():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, strategy="hybrid")
    assert [picker.fields[k].value for k in ("dp", "tp", "pp")] == [1, 1, 2]
    assert picker.problems == []
    assert "the degrees were auto" in picker.message  # said, not set silently
    assert "runs on 2 engines; change them above" in picker.message
    _set(picker, dp=2, pp=2)
    (problem,) = picker.problems
    assert problem.startswith("dp × tp × pp = 2 × 1 × 2 = 4 must equal the number of engines")
    advice = re.search(r"e\.g\. dp (\d) × tp (\d) × pp (\d)", problem)
    _set(picker, **dict(zip(("dp", "tp", "pp"), map(int, advice.groups()))))
    assert picker.problems == [] and not picker.button.disabled
    _set(picker, dp=2, tp=1, pp=1)
    assert picker.message.endswith("dp 2 × tp 1 × pp 1")  # degrees the user set: no note
    picker4 = StrategyPicker(FakePool(4), background=False)
    _set(picker4, strategy="hybrid")
    assert [picker4.fields[k].value for k in ("dp", "tp", "pp")] == [2, 1, 2]


@pytest.mark.parametrize(
    "text, problem",
    [
        ("0", "micro-batch must be a whole number of at least 1, got 0"),
        ("-5", "micro-batch must be a whole number of at least 1, got -5"),
        ("100000", "micro-batch 100000 is more than this picker runs (at most 4096)"),
        ("7.5", "micro-batch must be a whole number, not 7.5"),
        ("", "micro-batch is empty: type a whole number"),
        ("eight", "micro-batch must be a whole number, not eight"),
    ],
)
def test_number_boxes_refuse_instead_of_changing_the_value(text, problem):
    pool = FakePool(2)
    picker = StrategyPicker(pool, background=False)
    _set(picker, micro_batch=text)
    assert picker.fields["micro_batch"].value == text  # what was typed stays
    assert picker.problems == [problem]
    assert picker.message == f"cannot run: {problem}"
    assert picker.button.disabled
    picker._launch()
    assert pool.trained == []
    if not re.fullmatch(r"-?\d+", text):  # not a number at all: no config to make
        with pytest.raises(ValueError, match="micro-batch"):
            picker.config()


def test_steps_zero_is_refused_in_words():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, steps="0")
    assert picker.problems == ["steps must be a whole number of at least 1, got 0"]


def test_all_problems_at_once_in_the_labels_words():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, model="simple_cnn", strategy="tp", precision="fp16", grad_accum="1.5")
    assert picker.problems == [
        "grad accum must be a whole number, not 1.5",
        "strategy tp needs model tiny_gpt, hf:llama, hf:gpt2 or one with a parallel_plan() "
        "(it splits transformer layers), got simple_cnn",
        "precision fp16 needs backend deepspeed (its loss scaler); use bf16 or fp32 with "
        "backend torch",
    ]
    assert picker.message.startswith("cannot run:\n- grad accum")
    assert picker.explanation.value.count("<li>") == 3
    for p in picker.problems:
        assert not re.search(r"\w=|micro_batch|grad_accum|gpt\.|'", p), p  # no code syntax


@pytest.mark.parametrize(
    "values, reason",
    [
        (
            {"offload": "optimizer", "backend": "deepspeed", "strategy": "ddp"},
            "offload optimizer needs strategy zero1 or zero2 or zero3, got ddp",
        ),
        ({"strategy": "tp"}, "tp 4 must divide the model's attention heads 6"),
        ({"strategy": "tp", "backend": "deepspeed"}, "backend deepspeed supports strategies"),
        ({"strategy": "pipeline", "model": "simple_cnn"}, "needs model tiny_gpt"),
    ],
)
def test_invalid_combinations_are_explained_before_launch(values, reason):
    pool = FakePool(4)
    picker = StrategyPicker(pool, background=False, gpt=GPTConfig(d_model=24, n_heads=6))
    _set(picker, **values)
    assert picker.button.disabled is True
    assert reason in picker.message, picker.message
    picker._launch()  # a click on a disabled button does nothing
    assert pool.trained == []


def test_run_button_trains_the_widgets_config_and_lists_the_run():
    pool = FakePool(2)
    picker = StrategyPicker(pool, background=False)
    _set(
        picker,
        strategy="zero1",
        backend="deepspeed",
        micro_batch=4,
        grad_accum=2,
        steps=5,
        precision="bf16",
        offload="optimizer",
    )
    picker.button.click()
    (cfg,) = pool.trained
    assert (
        cfg.strategy,
        cfg.backend,
        cfg.micro_batch,
        cfg.grad_accum,
        cfg.steps,
        cfg.precision,
        cfg.offload,
    ) == ("zero1", "deepspeed", 4, 2, 5, "bf16", "optimizer")
    assert cfg == picker.config()
    assert picker.run is pool.runs[0] and picker.runs == [picker.run]
    assert isinstance(picker.dashboard, Dashboard)
    assert picker.dashboard.text == "done: 5/5 steps · 0.1 s/step"
    assert picker.dashboard.chart.points("loss") == 5
    assert "<td>picker.runs[0]</td>" in picker.runs_list.value.replace("<code>", "").replace(
        "</code>", ""
    )
    assert "zero1/deepspeed tiny_gpt" in picker.runs_list.value
    assert "<td>done</td>" in picker.runs_list.value
    assert picker.button.description == "Run" and not picker.button.disabled


def test_while_a_run_goes_run_is_disabled_and_stop_is_shown():
    pool = FakePool(2, finished=False)
    picker = StrategyPicker(pool, background=True)
    _set(picker, steps="5")
    picker.button.click()
    assert picker.running and picker.button.disabled
    assert picker.button.description == "running..."
    assert picker.stop_button.layout.display != "none" and not picker.stop_button.disabled
    assert picker.stop_button.button_style == "warning"
    picker._launch()  # a second click: nothing starts
    picker.button.click()
    assert len(pool.trained) == 1
    _set(picker, strategy="zero2")  # editing the form does not enable Run
    assert picker.button.disabled
    assert "<td>running</td>" in picker.runs_list.value
    picker.stop_button.click()
    assert pool.runs[0].stops == 1 and picker.stop_button.description == "stopping..."
    pool.runs[0].finished = True
    picker.dashboard.stop_following()
    picker.dashboard.follow()
    assert not picker.running and picker.button.description == "Run"
    assert not picker.button.disabled and picker.stop_button.layout.display == "none"
    assert "<td>done</td>" in picker.runs_list.value
    picker.button.click()
    assert len(picker.runs) == 2 and picker.run is picker.runs[1] is pool.runs[1]


def test_the_runs_list_counts_steps_while_the_run_goes():
    """The list of runs reads the steps the progress bar reads, not 0/N until the end."""
    pool = FakePool(2, finished=False)
    picker = StrategyPicker(pool, background=True)
    _set(picker, steps="6")
    picker.button.click()
    picker.dashboard.stop_following()
    run = pool.runs[0]
    whole, run.history = run.history, []
    picker.dashboard.update(force=True)
    assert "<td>0/6</td>" in picker.runs_list.value
    run.history = whole[: 2 * 4]  # 4 steps of 2 ranks
    picker.dashboard.update()
    assert picker.dashboard.text.startswith("step 4/6")
    assert "<td>4/6</td><td>" in picker.runs_list.value
    assert "<td>running</td>" in picker.runs_list.value
    run.history, run.finished = whole, True
    picker.dashboard.follow()
    assert "<td>6/6</td>" in picker.runs_list.value and "<td>done</td>" in picker.runs_list.value


def test_compare_these_runs_puts_the_finished_runs_side_by_side():
    pool = FakePool(2)
    picker = StrategyPicker(pool, background=False)
    _set(picker, steps="4")
    picker.button.click()
    assert picker.compare_button.layout.display == "none"  # one run: nothing to compare
    _set(picker, strategy="zero2")
    picker.button.click()
    assert picker.compare_button.layout.display is None
    cmp = picker.compare()
    assert [row["label"] for row in cmp.table] == ["runs[0] ddp/torch", "runs[1] zero2/torch"]
    assert cmp.table == nbpar.compare(picker.runs, labels=[r["label"] for r in cmp.table]).table
    pool.finished, picker.background = False, True  # a run still going is left out
    picker.button.click()
    picker.dashboard.stop_following()
    assert [row["label"] for row in picker.compare().table] == [
        "runs[0] ddp/torch",
        "runs[1] zero2/torch",
    ]
    picker._show_comparison()  # the button's handler shows it in its output area


def test_single_runs_on_one_rank_and_train_errors_are_shown():
    class Closed(FakePool):
        def train(self, cfg):
            raise RuntimeError("the pool is shut down")

    picker = StrategyPicker(Closed(2), background=False)
    _set(picker, strategy="single")
    assert picker.message == "ready: single/torch on 1 rank, dp 1 × tp 1 × pp 1"
    picker.button.click()
    assert picker.message == "could not start: the pool is shut down"
    assert picker.run is None and picker.button.disabled is False
    assert picker.button.description == "Run"


@pytest.mark.spawn  # FitPicker simulates pipeline layouts in spawned processes
def test_fit_picker_lists_the_layouts_that_fit_with_their_margin():
    from nbpar import FitPicker

    small = {"d_model": 96, "n_layers": 2, "n_heads": 3, "vocab_size": 256}
    picker = FitPicker("tiny_gpt", model_config=small, world_size=2, device_memory_gb=1e3)
    picker.fields["seq_len"].value = 16
    rows = picker.simulate()
    by = {r["strategy"]: r for r in rows}
    # context parallelism splits the sequence of this language model; no experts, no ep
    assert set(by) == {"ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "cp"}
    assert "tp=2 must divide" in by["tp"]["error"]  # 3 heads: refused with the reason
    assert by["cp"]["cp"] == 2 and by["cp"]["activation_bytes"] < by["ddp"]["activation_bytes"]
    peaks = sorted(r["peak_bytes"] for r in rows if "error" not in r)
    assert peaks[0] < peaks[-1] and by["zero3"]["peak_bytes"] < by["ddp"]["peak_bytes"]
    # a device between the smallest and the largest peak: exactly those below it fit
    cut = (peaks[0] + peaks[-1]) / 2
    picker.fields["device_memory_gb"].value = cut / 1e9
    rows = picker.simulate()
    fitting = [r["strategy"] for r in rows if r["fits"]]
    assert fitting and len(fitting) < len(peaks)
    assert all((r["peak_bytes"] <= cut) == r["fits"] for r in rows if "error" not in r)
    assert rows[: len(fitting)] == [r for r in rows if r["fits"]]  # those that fit first
    assert f"{len(fitting)} of {len(rows)} layouts fit 2 devices" in picker.result.value


@pytest.mark.spawn  # FitPicker simulates pipeline layouts in spawned processes
def test_fit_picker_says_what_is_wrong_in_one_line():
    from nbpar import FitPicker

    picker = FitPicker("hf:llama", world_size=2)
    picker.fields["model_config"].value = '{"hidden_size": 64,'
    assert picker.simulate() == []
    assert "is not JSON" in picker.result.value
    picker.fields["model_config"].value = '{"hidden_sise": 64}'
    assert picker.simulate() == []
    assert "hidden_sise" in picker.result.value and "\n" not in picker.result.value


def test_in_words_keeps_an_apostrophe_and_strips_quotes():
    from nbpar.view.picker_rules import in_words

    said = in_words("DeepSpeed's pipeline engine runs only the 1f1b schedule, got 'gpipe'")
    assert said == "DeepSpeed's pipeline engine runs only the 1f1b schedule, got gpipe"


@pytest.mark.parametrize(
    "field, typed, problem",
    [
        ("world_size", 0, "devices must be a whole number of at least 1, got 0"),
        ("world_size", -4, "devices must be a whole number of at least 1, got -4"),
        ("device_memory_gb", -80.0, "GB per device must be more than 0, got -80"),
        ("device_memory_gb", 0.0, "GB per device must be more than 0, got 0"),
        ("micro_batch", 0, "micro-batch must be a whole number of at least 1, got 0"),
    ],
)
def test_fit_picker_refuses_a_bad_number_and_keeps_it(field, typed, problem, monkeypatch):
    from nbpar import FitPicker
    from nbpar.simulate import fit

    monkeypatch.setattr(fit, "_fit_row", lambda *a: pytest.fail("simulated a refused value"))
    picker = FitPicker("tiny_gpt", world_size=2)
    picker.fields[field].value = typed
    assert picker.simulate() == []
    assert picker.fields[field].value == typed  # what was typed stays
    assert problem in picker.result.value


def test_fit_picker_shows_each_row_as_its_layout_finishes(monkeypatch):
    from nbpar import FitPicker
    from nbpar.simulate import fit

    seen = []
    peaks = {"ddp": 3e9, "zero1": 2e9, "zero3": 0.5e9}

    def row(c, world, gb):
        seen.append(picker.result.value)  # what the page showed before this layout ran
        peak = peaks[c.strategy]
        fits = peak <= gb * 1e9
        return dict(
            strategy=c.strategy,
            dp=world,
            tp=1,
            pp=1,
            peak_bytes=peak,
            fits=fits,
            margin_bytes=gb * 1e9 - peak,
        )

    monkeypatch.setattr(fit, "_fit_row", row)
    picker = FitPicker(
        "tiny_gpt", world_size=2, device_memory_gb=1.0, strategies=("ddp", "zero1", "zero3")
    )
    rows = picker.simulate()
    assert [r["strategy"] for r in rows] == ["zero3", "zero1", "ddp"]  # fits, then nearest
    assert "simulating every strategy" in seen[0]
    assert "ddp" in seen[1] and "simulating 2 more" in seen[1]
    assert "simulating 1 more" in seen[2] and "zero1" in seen[2]
    assert "1 of 3 layouts fit 2 devices of 1 GB" in picker.result.value
    assert "more..." not in picker.result.value
    assert "300%" in picker.result.value and "50%" in picker.result.value  # the bars


def test_global_batch_line_shows_no_product_of_a_refused_size():
    picker = StrategyPicker(FakePool(2), background=False)
    _set(picker, micro_batch="-1")
    assert picker.global_batch_text().endswith("= ? (see below)")
    _set(picker, micro_batch="4")
    assert picker.global_batch_text().endswith("= 4 × 1 × 2 = 8")


def test_hybrid_advice_keeps_the_degree_the_user_chose():
    from nbpar.view.picker_rules import hybrid_layout

    values = dict(model="tiny_gpt", micro_batch=8, grad_accum=2, steps=20)
    assert hybrid_layout(values, 8) == {"dp": 2, "tp": 2, "pp": 2, "cp": 1}  # nothing chosen
    assert hybrid_layout({**values, "tp": 4, "pp": 4}, 8)["tp"] == 4  # 4 x 4 > 8: keep tp
    assert hybrid_layout({**values, "dp": 8, "pp": 2}, 8)["pp"] == 2  # 8 x 2 > 8: keep pp


def test_context_parallelism_shows_its_degree_and_attention_and_explains_bad_mixes():
    picker = StrategyPicker(FakePool(4), background=False)
    _set(picker, strategy="cp")
    assert {"cp", "attention"} <= _shown(picker) and not {"dp", "ep"} & _shown(picker)
    assert picker.message == "ready: cp/torch on 4 ranks, dp 1 × tp 1 × pp 1 × cp 4"
    _set(picker, cp=2)
    assert picker.message == "ready: cp/torch on 4 ranks, dp 2 × tp 1 × pp 1 × cp 2"
    _set(picker, cp=4, attention="ulysses")  # tiny_gpt: 4 heads, 32 tokens
    assert picker.problems == []
    _set(picker, model="hf:gpt2")  # its attention is not one nbpar replaces
    assert picker.problems == [
        "context parallelism replaces the model's attention: it runs tiny_gpt and "
        "hf:llama, not hf:gpt2"
    ]
    _set(picker, model="tiny_gpt", strategy="hybrid", cp=4, dp=1, tp=1, pp=1)
    assert "attention" in _shown(picker)
    _set(picker, cp=1)
    assert "attention" not in _shown(picker)  # no sequence split: nothing to choose


def test_a_sequence_the_split_does_not_divide_is_explained_before_launch():
    picker = StrategyPicker(FakePool(3), background=False, gpt=C.GPTConfig(seq_len=32))
    _set(picker, strategy="cp")
    assert picker.problems == [
        "cp 3 with attention ring deals each sequence in 2 x cp chunks (the zigzag split): "
        "the model's context length 32 does not divide by 6"
    ]
    assert picker.button.disabled


def test_checkpointing_and_sequence_parallelism_are_chosen_where_they_apply():
    picker = StrategyPicker(FakePool(2), background=False)
    assert "sequence_parallel" not in _shown(picker)  # ddp: no tensor parallelism
    _set(picker, strategy="tp")
    assert "sequence_parallel" in _shown(picker)
    _set(picker, sequence_parallel=True, activation_checkpointing="selective")
    cfg = picker.config()
    assert cfg.sequence_parallel and cfg.activation_checkpointing == "selective"
    assert picker.problems == []
    _set(picker, strategy="ddp")  # hidden again: the config does not carry it
    assert not picker.config().sequence_parallel
    _set(picker, model="simple_cnn")
    assert "activation_checkpointing" not in _shown(picker)
    assert picker.config().activation_checkpointing is False
