"""The step loop that runs on every engine: any strategy, same loop.

`run_training(cfg)` works inside any process that already has a default
torch.distributed process group (an engine, a `%%dist` cell, a test worker)
or none at all (strategy single). It builds the topology, the model, the
strategy's StepRunner and this rank's data shard, runs ``cfg.steps`` optimizer
steps of ``cfg.grad_accum`` micro-batches each, and reports per-step loss,
memory and the compute/communication split. ``checkpoint_every`` saves
through `nbpar.train.checkpoint`; ``resume_from`` continues at the saved step and
data position (epoch + batches consumed), so the loss curve goes on unchanged.

Step loss convention: a runner's ``train_step`` returns this rank's mean loss
over its micro-batches; with pipelining only the last stage's value must be
right (other stages may return anything). train.py broadcasts it from the last
pp stage over the pp group, then averages over the dp group (with context parallelism,
over every data and context rank: each cp rank's loss is the mean over its equal share
of the tokens), so every rank reports the loss of the whole global batch, equal to the
single-process loss.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from nbpar import device
from nbpar.config import TrainConfig
from nbpar.measure import machine
from nbpar.measure.blocked import BlockedClock
from nbpar.measure.clocks import step_clock
from nbpar.measure.comm import CommMeter, exchange_launches
from nbpar.measure.memtrack import StepMemory
from nbpar.measure.metrics import CommTimer, memory_snapshot, step_peak_bytes
from nbpar.measure.records import MEMORY_PARTS, RankResult, StepRecord, routing_total
from nbpar.measure.step_split import SETUP_STEPS, blocked_shares, share_summary
from nbpar.model.data import build_loader
from nbpar.model.models import build_model
from nbpar.model.moe import take_routing
from nbpar.parallel import build_runner
from nbpar.train import checkpoint
from nbpar.train.context import RankContext


class _Batches:
    """Endless micro-batches of one rank; a new epoch re-shuffles via set_epoch."""

    def __init__(self, loader, dev):
        self.loader, self.dev, self.epoch, self.taken = loader, dev, 0, 0
        self._it = iter(loader)

    def next(self):
        try:
            x, y = next(self._it)
        except StopIteration:
            self.seek(self.epoch + 1, 0)
            x, y = next(self._it)
        self.taken += 1
        return x.to(self.dev), y.to(self.dev)

    def position(self) -> dict:
        """Where a checkpoint must continue: the epoch and batches taken from it."""
        return {"epoch": self.epoch, "batches_in_epoch": self.taken}

    def seek(self, epoch: int, taken: int) -> None:
        """Continue at batch ``taken`` of ``epoch`` (same order: seed + epoch)."""
        self.epoch, self.taken = epoch, 0
        self.loader.sampler.set_epoch(epoch)
        self._it = iter(self.loader)
        for _ in range(taken):
            next(self._it)
            self.taken += 1


def _global_loss(loss, ctx: RankContext, timer: CommTimer) -> tuple[float, float]:
    """(loss of the global batch: last pp stage's value averaged over the data (and
    context) ranks, this rank's own value before that average), read with one device
    sync."""
    t = torch.as_tensor(loss).detach().to(device=ctx.device, dtype=torch.float32).reshape(1)
    t = t.clone()
    pp, data = ctx.group("pp"), ctx.data_group()
    with timer.span():
        if pp is not None:
            dist.broadcast(t, group=pp, group_src=ctx.dims.pp - 1)
        local = t.clone()
        if data is not None:
            dist.all_reduce(t, group=data)
            t /= ctx.dims.dp * ctx.dims.cp
        return tuple(torch.cat([t, local]).tolist())


def _agree_to_stop(should_stop, ctx: RankContext) -> bool:
    """All ranks stop together if any rank's ``should_stop()`` says so."""
    flag = torch.tensor([1.0 if should_stop() else 0.0], device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


#: A run meters the collectives of its third step and of every METER_EVERY-th step after
#: it, so the live view's communication figures stay current on long runs. The first two
#: carry one-off set-up: FSDP's lazy init in the first, and DDP rebuilds its buckets in the
#: second (a broadcast from rank 0 that every rank waits for). A metered step runs several
#: times slower (every op passes through Python), so the others are left alone.
METER_EVERY = 20

#: Whether each step times the training thread's blocked seconds (`BlockedClock`); only
#: `benchmarks/meter_cost.py` turns it off, to measure what it costs.
BLOCKED_CLOCK = True


def is_metered(step: int, start: int, steps: int) -> bool:
    """Whether ``step`` of a run over steps ``start .. steps-1`` is metered."""
    first = min(start + 2, steps - 1)
    return step >= first and (step - first) % METER_EVERY == 0


def wrap_phase(cfg: TrainConfig) -> str:
    """What building ``cfg``'s runner does, in words a progress line can show."""
    if cfg.backend == "deepspeed":
        return "importing DeepSpeed and building its engine"
    return f"wrapping the model for {cfg.strategy}"


def run_training(
    cfg: TrainConfig | dict, *, publish=None, should_stop=None, on_finish=None, phase=None
) -> RankResult:
    """Train ``cfg`` on this rank and return its summary (see module docstring).

    ``publish(record)`` is called once per step; ``should_stop()`` is checked
    before each step (all ranks agree, so nobody is left in a collective);
    ``on_finish(runner)`` sees the trained runner (model, optimizer) before it
    is closed, e.g. to keep or save the weights; ``phase(text)`` hears each stage of
    the set-up before the first step ends (what a run's "starting..." line shows).
    """
    phase = phase or (lambda text: None)
    if isinstance(cfg, dict):
        cfg = TrainConfig.from_dict(cfg)
    phase("building the device mesh")
    ctx, cfg = RankContext.build(cfg)
    runner = None
    try:
        phase(f"building the model {cfg.model}")
        model = build_model(cfg).to(ctx.device)
        phase(wrap_phase(cfg))
        runner = build_runner(model, cfg, ctx.mesh)
        runner.set_update_rule(cfg, ctx.group("pp"))
        phase("loading the data")
        loader = build_loader(cfg, ctx.dims.coords(ctx.rank)["dp"], ctx.dims.dp, epoch=0)
        batches = _Batches(loader, ctx.device)
        if cfg.resume_from is not None:
            phase(f"resuming from {cfg.resume_from}")
        start = 0 if cfg.resume_from is None else checkpoint.resume(cfg, runner, batches, ctx)
        runner.steps_taken = start
        phase("the first step (its one-off set-up included)")
        result = _loop(cfg, runner, batches, ctx, publish, should_stop, start)
        if on_finish is not None:
            on_finish(runner)
        return result
    finally:
        if runner is not None:
            runner.close()


def _loop(cfg, runner, batches, ctx: RankContext, publish, should_stop, start) -> RankResult:
    """Steps ``start .. cfg.steps - 1`` (fewer if the ranks agree to stop), each
    published and checkpointed when due; then this rank's summary."""
    timer = getattr(runner, "comm_timer", None) or CommTimer()
    timer.marks = step_clock(ctx.backend)  # the device's stream on a GPU, not the launches
    # on a GPU the host thread also waits for its kernels: no blocked clock there
    blocked = BlockedClock() if BLOCKED_CLOCK and ctx.device.type == "cpu" else None
    device.reset_peak(ctx.backend)  # garbage collected first: no earlier run's tensors
    history: list[StepRecord] = []
    comm = None  # the latest metered step's meter
    clocks = machine.snapshot()  # what the host did over the steps: the timings' verdict
    for step in range(start, cfg.steps):
        if should_stop is not None and _agree_to_stop(should_stop, ctx):
            break
        record, meter = _step(cfg, runner, batches, ctx, timer, step, start, blocked)
        if meter is not None:
            comm = meter
        history.append(record)
        if publish is not None:
            publish(dict(record))
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            checkpoint.save(cfg, runner, step + 1, batches.position(), ctx)
    usage = machine.usage(clocks, torch.get_num_threads())
    summary = _summary(history, runner, ctx, comm)
    return {**summary, **_blocked_summary(history, blocked), "machine": usage}


def _step(cfg, runner, batches, ctx, timer: CommTimer, step: int, start: int, blocked=None):
    """Train step ``step``; (its record, its CommMeter when the step is metered, else None).
    ``blocked`` (a `BlockedClock`, or None) times the thread's blocked seconds in it."""
    # the GPU's peak from here: per step like the CPU figures (collected at the run's start)
    device.reset_peak(ctx.backend, collect=False)
    micro_batches = [batches.next() for _ in range(cfg.grad_accum)]
    timer.start_step()
    if blocked is not None:
        blocked.start()
    comm = mem = None
    if is_metered(step, start, cfg.steps):
        with CommMeter(marks=step_clock(ctx.backend)) as comm, StepMemory(runner) as mem:
            loss = runner.train_step(micro_batches)
    else:
        loss = runner.train_step(micro_batches)
    device.synchronize(ctx.backend)
    loss, local = _global_loss(loss, ctx, timer)
    blocked_s = blocked.stop() if blocked is not None else None
    step_s = timer.end_step()
    comm_s = timer.comm_s()
    if comm is not None and ctx.distributed and ctx.world > 1:
        exchange_launches(comm)  # outside the step's time: how long ops waited
    global_batch = cfg.global_batch(ctx.world)
    tokens = cfg.gpt.seq_len if cfg.dataset_name() == "pysource" else None
    record: StepRecord = {
        "step": step,
        "rank": ctx.rank,
        "loss": loss,
        "local_loss": local,
        "step_time_s": step_s,
        "compute_s": step_s - comm_s,
        "comm_s": comm_s,
        "comm_blocked_s": blocked_s,
        "samples_per_s": global_batch / step_s,
        "tokens_per_s": global_batch * tokens / step_s if tokens else None,
        **runner.memory(),
        **memory_snapshot(ctx.backend),
        "time": time.time(),
    }
    routing = take_routing(runner.model) if runner.model is not None else None
    if routing is not None:  # a mixture of experts: tokens per expert per layer
        record["tokens_per_expert"] = routing
    if comm is not None:  # this step ran slower: every op went through Python
        record.update(_metered_figures(comm, mem, record))
    record["peak_bytes"] = step_peak_bytes(record)
    return record, comm


def _metered_figures(comm: CommMeter, mem: StepMemory, record: StepRecord) -> dict:
    """What a metered step adds to its record: its collectives and its memory."""
    figures = {
        "comm_bytes": comm.total(),
        "comm_bytes_by_op": comm.by_op(),
        "comm_in_flight_s": comm.comm_s(),
        "exposed_comm_s": comm.exposed_transfer_s(),
        "comm_wait_s": comm.wait_s(),
        "comm_window_s": comm.window_s(),
        "comm_metered": True,
        **mem.figures(),
    }
    if "activation_peak_bytes" in record:  # a pipeline counts its own, per stage
        figures["activation_bytes"] = record["activation_peak_bytes"]
    return figures


def _summary(history: list[StepRecord], runner, ctx: RankContext, comm) -> RankResult:
    """This rank's result: the last step's model states, the run's peaks of memory, a
    normal step's time and the metered steps' communication (see `RankResult`)."""
    last = history[-1] if history else _idle_record(runner, ctx)
    metered = [r for r in history if r.get("comm_metered")]
    first = metered[0] if metered else {}
    # a normal step: the median of those neither metered (every op through Python is
    # slower) nor one of the first two (one-off set-up), where the run had such steps
    step_s = statistics.median(
        [r["step_time_s"] for r in history[SETUP_STEPS:] if not r.get("comm_metered")]
        or [r["step_time_s"] for r in history if not r.get("comm_metered")]
        or [r["step_time_s"] for r in history]
        or [0.0]
    )
    bubble = getattr(runner, "bubble_fraction", None)
    forced = getattr(runner, "schedule_bubble_fraction", None)
    with_stalls = getattr(runner, "bubble_fraction_with_stalls", None)
    timelines = getattr(runner, "timelines", None)
    return {
        "rank": ctx.rank,
        "losses": [r["loss"] for r in history],
        **{key: last[key] for key in MEMORY_PARTS},
        # peaks of this run only: tracked memory (device allocator on GPUs), and the
        # process's resident memory as its own figure
        "peak_bytes": max([r["peak_bytes"] for r in history], default=last["peak_bytes"]),
        "process_peak_bytes": max([r["rss_bytes"] for r in history], default=last["rss_bytes"]),
        "activation_bytes": first.get("activation_bytes"),
        "memory_error": first.get("memory_error"),
        "step_time_s": step_s,
        **_comm_summary(history, metered, comm),
        "bubble_fraction": bubble() if callable(bubble) else None,
        # the part of the bubble the schedule forces with the measured stage times
        "schedule_bubble_fraction": forced() if callable(forced) else None,
        # the same typical step's bubble with its stalls as they ran
        "bubble_fraction_with_stalls": with_stalls() if callable(with_stalls) else None,
        # which step the bubbles and timeline are: step, typical, normal_steps, metered, stalls
        "bubble_step": timelines.about() if timelines is not None else None,
        "tokens_per_expert": routing_total(history),
        "history": history,
    }


def _blocked_summary(history: list[StepRecord], blocked) -> dict:
    """The share of a normal step the training thread spent blocked (`BlockedClock`:
    communication that compute did not hide, waiting for a slower rank included): the
    median of blocked seconds over step seconds across this rank's normal steps (neither
    metered nor one of the first two, `step_split.blocked_shares`) and its spread; None
    without a clock."""
    normal = blocked_shares(history)
    return {
        "comm_blocked_fraction": statistics.median(normal) if normal else None,
        "comm_blocked_fraction_spread": [min(normal), max(normal)] if normal else None,
        "comm_blocked_steps": len(normal),
        "comm_blocked_method": blocked.method if blocked is not None else None,
    }


def _idle_record(runner, ctx: RankContext) -> dict:
    """The memory figures of a run that took no step (stopped before its first)."""
    figures = {**runner.memory(), **memory_snapshot(ctx.backend)}
    figures["peak_bytes"] = step_peak_bytes(figures)
    return figures


def _comm_summary(history, metered, comm) -> dict:
    """The run's communication: bytes this rank sends under the ring algorithm, counted at
    the c10d call, in one training step (the latest metered one), by kind of op; seconds
    with an op in flight, the part no compute hid once every rank had joined (exposed),
    and the part spent waiting for a slower rank to join (wait), from the metered step
    with the median in-flight time; and each as a share of its metered step, the median
    over the metered steps with its spread (`step_split.share_summary`: measured, never
    scaled to a normal step). Without a
    metered step, the timer's share of all steps (what the DDP hook and the loss
    all-reduce saw)."""
    by_flight = sorted(metered, key=lambda r: r.get("comm_in_flight_s") or 0.0)
    pick = by_flight[(len(by_flight) - 1) // 2] if by_flight else {}
    shares = share_summary(metered)
    if not metered:
        total_step = sum(r["step_time_s"] for r in history)
        total_comm = sum(r["comm_s"] for r in history)
        shares["comm_fraction"] = total_comm / total_step if total_step > 0 else 0.0
    return {
        "comm_bytes": comm.total() if comm is not None else None,
        "comm_bytes_by_op": comm.by_op() if comm is not None else None,
        "comm_s": pick.get("comm_in_flight_s"),
        "exposed_comm_s": pick.get("exposed_comm_s"),
        "comm_wait_s": pick.get("comm_wait_s"),
        **shares,
    }
