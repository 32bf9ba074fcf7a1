"""run_training end to end: DDP on 2 gloo processes equals the single-process run."""

import pytest
import torch

from nbpar.config import TrainConfig
from nbpar.train.loop import run_training
from tests.distributed import run_distributed

MODELS = ("simple_cnn", "tiny_gpt")
RECORD_KEYS = {
    "step",
    "rank",
    "loss",
    "step_time_s",
    "compute_s",
    "comm_s",
    "samples_per_s",
    "tokens_per_s",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "rss_bytes",
    "peak_bytes",
    "local_loss",
}


def _params(box):
    """on_finish callback: keep the trained weights as numpy (picklable by value)."""

    def grab(runner):
        model = getattr(runner.model, "module", runner.model)
        box.extend(p.detach().numpy().copy() for p in model.parameters())

    return grab


def _train(rank, world, strategy, micro):
    """20 steps of each model; for ddp also a stopped run (publish + should_stop)."""
    out = {}
    for model in MODELS:
        box = []
        cfg = TrainConfig(model=model, strategy=strategy, micro_batch=micro, steps=20)
        res = run_training(cfg, on_finish=_params(box))
        res["params"] = box
        out[model] = res
    if strategy == "ddp":
        records = []
        cfg = TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=micro, steps=10)
        res = run_training(
            cfg.to_dict(),
            publish=records.append,
            should_stop=lambda: rank == 0 and len(records) >= 3,
        )
        out["stopped"] = {"result": res, "records": records}
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_train, 1, "single", 8)[0]


@pytest.fixture(scope="module")
def ddp():
    return run_distributed(_train, 2, "ddp", 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", MODELS)
def test_ddp_losses_equal_single_process(single, ddp, model):
    ref = torch.tensor(single[model]["losses"])
    assert len(ref) == 20 and ref[-5:].mean() < ref[:5].mean()  # it learns
    for rank in range(2):
        got = torch.tensor(ddp[rank][model]["losses"])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert ddp[0][model]["losses"] == ddp[1][model]["losses"]  # identical on all ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", MODELS)
def test_ddp_replicas_stay_identical(single, ddp, model):
    for a, b in zip(ddp[0][model]["params"], ddp[1][model]["params"]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=0, rtol=0)
    for a, ref in zip(ddp[0][model]["params"], single[model]["params"]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(ref), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(120)
def test_summary_fields(single, ddp):
    for res in (single["tiny_gpt"], ddp[1]["tiny_gpt"]):
        assert res["param_bytes"] == sum(p.nbytes for p in res["params"])
        assert res["grad_bytes"] == res["param_bytes"]
        assert res["optim_bytes"] == 2 * res["param_bytes"]  # Adam: exp_avg, exp_avg_sq
        assert res["peak_bytes"] > res["param_bytes"] and res["step_time_s"] > 0
        assert res["bubble_fraction"] is None and len(res["history"]) == 20
    assert ddp[1]["tiny_gpt"]["rank"] == 1
    assert single["tiny_gpt"]["comm_fraction"] == 0  # one process: nothing to send
    for rank in range(2):  # gradient all-reduce was timed on every rank
        assert ddp[rank]["tiny_gpt"]["comm_fraction"] > 0


@pytest.mark.timeout(120)
def test_should_stop_and_publish(ddp):
    for rank in range(2):
        stopped = ddp[rank]["stopped"]
        # rank 0 asked to stop after 3 steps; both ranks stop at the same boundary
        assert len(stopped["result"]["losses"]) == 3
        assert [r["step"] for r in stopped["records"]] == [0, 1, 2]
        for rec in stopped["records"]:
            assert RECORD_KEYS <= set(rec) and rec["rank"] == rank
            # DDP on 2 ranks always communicates (bucket all-reduces, the loss all-reduce),
            # and a step holds its communication
            assert rec["tokens_per_s"] > 0 and 0 < rec["comm_s"] < rec["step_time_s"]
        # a re-run in the same process group reproduces the first run's losses
        assert stopped["result"]["losses"] == ddp[rank]["tiny_gpt"]["losses"][:3]
    for i in range(3):  # each rank's loss on its own batches; their mean is the global loss
        local = [ddp[r]["stopped"]["records"][i]["local_loss"] for r in range(2)]
        assert local[0] != local[1]
        assert sum(local) / 2 == pytest.approx(ddp[0]["stopped"]["records"][i]["loss"], rel=1e-6)


@pytest.mark.timeout(120)
def test_grad_accum_equals_bigger_micro_batch_without_process_group():
    kw = dict(model="simple_cnn", strategy="single", steps=6)
    accum = run_training(TrainConfig(micro_batch=4, grad_accum=2, **kw))
    whole = run_training(TrainConfig(micro_batch=8, grad_accum=1, **kw))
    torch.testing.assert_close(
        torch.tensor(accum["losses"]), torch.tensor(whole["losses"]), atol=1e-5, rtol=0
    )
    assert accum["history"][0]["tokens_per_s"] is None
    assert accum["history"][0]["samples_per_s"] > 0


def test_batches_roll_over_into_a_reshuffled_epoch():
    from torch.utils.data import TensorDataset

    from nbpar.model.data import build_loader
    from nbpar.train.loop import _Batches

    cfg = TrainConfig(micro_batch=4, seed=2)
    ds = TensorDataset(torch.arange(16), torch.arange(16))
    batches = _Batches(build_loader(cfg, 1, 2, dataset=ds), torch.device("cpu"))
    seen = [batches.next()[0] for _ in range(4)]  # 2 micro-batches per epoch
    assert batches.epoch == 1
    epoch1 = [x for x, _ in build_loader(cfg, 1, 2, epoch=1, dataset=ds)]
    assert torch.equal(torch.cat(seen[2:]), torch.cat(epoch1))
    assert not torch.equal(torch.cat(seen[:2]), torch.cat(seen[2:]))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_digits_training_runs_past_an_epoch():
    """More steps than one epoch holds: training continues on a reshuffled epoch."""
    cfg = TrainConfig(
        model="simple_cnn",
        strategy="single",
        dataset="digits",
        micro_batch=512,
        steps=4,
        optimizer="sgd",
    )
    res = run_training(cfg)  # 1797 digits -> 3 micro-batches per epoch
    assert len(res["losses"]) == 4


def test_parallel_strategy_without_process_group_is_rejected():
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        run_training(TrainConfig(strategy="ddp", steps=1))


def test_metered_steps_are_the_third_then_every_meter_every_th():
    from nbpar.train.loop import METER_EVERY, is_metered

    every = METER_EVERY
    assert [s for s in range(50) if is_metered(s, 0, 50)] == [2, 2 + every, 2 + 2 * every]
    assert [s for s in range(5, 30) if is_metered(s, 5, 30)] == [7, 7 + every]  # resumed at 5
    assert [s for s in range(2) if is_metered(s, 0, 2)] == [1]  # a short run: its last step
    assert [s for s in range(1) if is_metered(s, 0, 1)] == [0]  # a one-step run: its only step


@pytest.mark.timeout(120)
def test_a_run_reports_its_metered_steps_communication(ddp):
    from nbpar.train.loop import is_metered

    for rank in range(2):
        res = ddp[rank]["tiny_gpt"]
        metered = [r for r in res["history"] if r.get("comm_metered")]
        assert [r["step"] for r in metered] == [s for s in range(20) if is_metered(s, 0, 20)]
        assert res["comm_s"] == metered[0]["comm_in_flight_s"] > 0
        assert res["exposed_comm_s"] == metered[0]["exposed_comm_s"]
        assert res["comm_wait_s"] == metered[0]["comm_wait_s"]  # the ranks told each other
        assert res["exposed_comm_s"] + res["comm_wait_s"] <= res["comm_s"] + 1e-9
        assert res["comm_bytes"] == metered[0]["comm_bytes"] > 0
