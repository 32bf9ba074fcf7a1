"""The step record and the run result are typed once (`nbpar.measure.records`): a real
run's records and result carry exactly the keys the types declare, so the types cannot
drift from what the loop writes, and the memory rules every reader uses hold."""

import pytest

from nbpar.config import TrainConfig
from nbpar.measure import records
from nbpar.train.loop import run_training

#: ``nbpar train --json``'s per-rank keys, in their order (the contract, DESIGN.md)
CONTRACT_RANK_KEYS = [
    "rank",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "peak_bytes",
    "comm_bytes",
    "comm_bytes_by_op",
    "comm_s",
    "exposed_comm_s",
    "comm_wait_s",
    "activation_bytes",
    "process_peak_bytes",
    "comm_fraction",
    "exposed_comm_fraction",
    "comm_wait_fraction",
    "comm_fraction_spread",
    "exposed_comm_fraction_spread",
    "comm_wait_fraction_spread",
    "comm_metered_steps",
    "comm_blocked_fraction",
    "comm_blocked_fraction_spread",
    "comm_blocked_steps",
    "comm_blocked_method",
    "tokens_per_expert",
]


@pytest.fixture(scope="module")
def run():
    """A real 3-step run (its third step metered) and the records it published."""
    published = []
    cfg = TrainConfig(model="tiny_gpt", strategy="single", micro_batch=4, steps=3)
    return run_training(cfg, publish=published.append), published


@pytest.mark.timeout(120)
def test_step_records_carry_exactly_the_declared_keys(run):
    res, published = run
    required = set(records.StepRecord.__required_keys__)
    declared = required | records.StepRecord.__optional_keys__
    assert len(published) == 3 and published == res["history"]
    for rec in published:
        assert not required - set(rec), f"step {rec['step']} lacks {required - set(rec)}"
        assert not set(rec) - declared, f"undeclared in StepRecord: {set(rec) - declared}"
    metered = [rec for rec in published if rec.get("comm_metered")]
    assert [rec["step"] for rec in metered] == [2]  # so the metered keys are checked too
    assert {"comm_bytes", "comm_in_flight_s", "tracked_peak_bytes"} <= set(metered[0])


@pytest.mark.timeout(120)
def test_the_result_carries_exactly_the_declared_keys(run):
    res, _ = run
    assert not records.RankResult.__optional_keys__
    assert set(res) == set(records.RankResult.__required_keys__)


@pytest.mark.timeout(120)
def test_a_contract_row_is_the_results_figures_in_contract_order(run):
    res, _ = run
    row = records.result_rank(res)
    assert list(row) == CONTRACT_RANK_KEYS
    assert row == {key: res[key] for key in CONTRACT_RANK_KEYS}


@pytest.mark.timeout(120)
def test_model_states_are_the_three_parts(run):
    res, _ = run
    parts = res["param_bytes"] + res["grad_bytes"] + res["optim_bytes"]
    assert records.model_state_bytes(res) == parts > 0
    assert records.model_states({"param_bytes": 3, "grad_bytes": None}) == {
        "params": 3,
        "grads": 0,
        "optimizer": 0,
    }


def test_what_holds_memory_is_the_first_figure_measured():
    gpu = {"device_allocated_bytes": 0, "rss_bytes": 5}  # a measured 0 is a figure
    assert records.memory_key(gpu) == "device_allocated_bytes" and records.held_bytes(gpu) == 0
    cpu = {"device_allocated_bytes": None, "rss_bytes": 5}
    assert records.memory_key(cpu) == "rss_bytes" and records.held_bytes(cpu) == 5
    assert records.held_bytes({"rss_bytes": 7}) == 7
    assert records.memory_key({}) == "rss_bytes" and records.held_bytes({}) is None


def test_the_views_read_memory_by_the_same_rule():
    """A GPU record whose allocator holds nothing: the device figure is read, not the RSS,
    by the live view's panels and by the figures' "other" part alike."""
    from nbpar.view.history import memory_parts
    from nbpar.view.live import build_spec

    gpu = {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}
    gpu |= {"device_allocated_bytes": 0, "rss_bytes": 5 * 2**30}
    assert build_spec([0], [gpu])["memory_key"] == "device_allocated_bytes"
    assert memory_parts(gpu)["other"] == 0
    cpu = {**gpu, "device_allocated_bytes": None, "param_bytes": 2**30}
    assert build_spec([0], [cpu])["memory_key"] == "rss_bytes"
    assert memory_parts(cpu) == {"params": 2**30, "grads": 0, "optimizer": 0, "other": 4 * 2**30}
