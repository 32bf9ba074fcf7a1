"""What a run reports, typed once: the step record each rank publishes, and its result.

Records travel as plain dicts (ipyparallel's data publication, ``json.dumps``), so the
types are TypedDicts: they name the keys `nbpar.train.loop` writes and what each figure
means, and cost nothing at run time. The memory rules every reader shares live here too:
which parts are model states (`MEMORY_PARTS`), their sum (`model_state_bytes`) and what
holds a rank's memory (`memory_key`, `held_bytes`). Imports nothing.
"""

from __future__ import annotations

from typing import TypedDict

#: The model states a rank holds, in the order tables show them (ZeRO's three parts).
MEMORY_PARTS = ("param_bytes", "grad_bytes", "optim_bytes")
#: What figures and tables call each part.
PART_NAMES = {"param_bytes": "params", "grad_bytes": "grads", "optim_bytes": "optimizer"}
#: What holds a rank's memory, first measured wins: the device allocator (GPU), the RSS.
HELD_KEYS = ("device_allocated_bytes", "rss_bytes")


class ModelStates(TypedDict):
    """Bytes of the model states this rank holds after a step (a runner's ``memory()``)."""

    param_bytes: int  # parameters: this rank's shard or stage where they are split
    grad_bytes: int  # gradients held after the step (DeepSpeed: at its last boundary)
    optim_bytes: int  # optimizer state (Adam moments; fp32 masters under mixed precision)


class _Ranked(TypedDict):
    rank: int  # global rank in the run's process group (0 for strategy single)


class _StepRequired(_Ranked, ModelStates):
    step: int  # optimizer step index, from 0 (a resumed run goes on from its checkpoint)
    loss: float  # loss of the whole global batch, the same on every rank
    local_loss: float  # this rank's own loss before the dp average
    step_time_s: float  # wall seconds of the step, device synchronized
    compute_s: float  # step_time_s - comm_s
    comm_s: float  # seconds a collective the runner's timer wraps was in flight
    samples_per_s: float  # global samples per second of this step
    tokens_per_s: float | None  # global tokens per second; None where samples are no text
    rss_bytes: int  # this process's resident memory after the step
    peak_bytes: int  # peak of tracked memory in the step (`metrics.step_peak_bytes`)
    time: float  # Unix seconds when the record was made


class StepRecord(_StepRequired, total=False):
    """One record per (step, rank); the keys below appear only where they were measured."""

    device_allocated_bytes: int  # GPU: the allocator's bytes after the step
    device_peak_bytes: int  # GPU: the allocator's peak in the step
    device_util_pct: int  # GPU: utilization in percent, where NVML answers
    offload_bytes: int  # DeepSpeed: bytes of the model states offloaded to host memory
    activation_peak_bytes: int  # pipeline: peak bytes of activations this stage kept
    # a mixture of experts: tokens this rank's batch sent to each expert in the step, per
    # MoE layer held here ({layer: [count per expert]}; k per token, every micro-batch)
    tokens_per_expert: dict[str, list[int]]
    expert_param_bytes: int  # expert parallelism: bytes of the experts this rank holds
    # every step on a CPU (`nbpar.measure.blocked`); None on a GPU
    comm_blocked_s: float | None  # seconds the training thread was blocked in the step
    # a metered step (`nbpar.train.loop.is_metered`); it runs slower, every op in Python
    comm_metered: bool  # True: the figures below were measured on this step
    # ring bytes: bytes a rank sends under the ring algorithm, counted at the c10d call
    # (each op's tensor sizes x its ring factor, `nbpar.measure.comm`), not wire bytes
    comm_bytes: int  # ring bytes of the step, every collective together
    comm_bytes_by_op: dict[str, int]  # the same by kind of collective
    comm_in_flight_s: float  # seconds with a collective in flight
    exposed_comm_s: float  # of those, seconds no compute hid once every rank joined
    comm_wait_s: float  # of those, seconds spent waiting for a slower rank to join
    comm_window_s: float  # the metered step's own seconds: the shares' whole
    tracked_peak_bytes: int  # peak of live tensor storage in the step (`memtrack`)
    activation_bytes: int  # peak of storage saved for backward
    memory_error: str  # why the memory meter could not follow the step (instead of both)


class MachineUsage(TypedDict):
    """What this rank's host did over its steps (`nbpar.measure.machine.usage`)."""

    host: str  # the host's name
    cores: int  # the host's CPU cores
    threads: int  # torch's intra-op threads in this rank's process
    wall_s: float  # wall seconds from the first step's start to the last step's end
    cpu_s: float  # CPU seconds this rank's process got in that time
    host_busy_s: float  # CPU seconds the whole host was busy in that time


class RankResult(_Ranked, ModelStates):
    """What `nbpar.train.loop.run_training` returns on one rank (model states: last step's)."""

    losses: list[float]  # the global batch's loss per step
    peak_bytes: int  # peak of tracked memory over this run
    process_peak_bytes: int  # peak resident memory of the process over this run
    activation_bytes: int | None  # the first metered step's; None without one
    memory_error: str | None  # why the memory meter failed on that step, else None
    # a normal step: the median of the unmetered steps after the first two (all the
    # unmetered ones in a shorter run), seconds
    step_time_s: float
    comm_bytes: int | None  # ring bytes (`StepRecord`) of the last metered step; None without one
    comm_bytes_by_op: dict[str, int] | None  # the same by kind of collective
    # the median metered step by in-flight time: seconds in flight, exposed, waiting
    comm_s: float | None
    exposed_comm_s: float | None
    comm_wait_s: float | None
    # each as a share of its metered step, the median over the metered steps
    # (`nbpar.measure.step_split.share_summary`), and its [lowest, highest];
    # comm_fraction falls back to the timer's share when no step was metered
    comm_fraction: float
    exposed_comm_fraction: float | None
    comm_wait_fraction: float | None
    comm_fraction_spread: list[float] | None
    exposed_comm_fraction_spread: list[float] | None
    comm_wait_fraction_spread: list[float] | None
    comm_metered_steps: int  # how many steps were metered
    # every normal step (`nbpar.measure.blocked`: exposed communication and waiting for a
    # slower rank together, measured without slowing the step): the median share of its
    # step and [lowest, highest]; None on a GPU
    comm_blocked_fraction: float | None
    comm_blocked_fraction_spread: list[float] | None
    comm_blocked_steps: int  # how many steps the share is the median of
    comm_blocked_method: str | None  # "schedstat", or "thread_time" (core waits counted)
    # pipeline: measured idle share of the pp ranks in a typical normal step, its stalls
    # left out (`nbpar.measure.timeline`)
    bubble_fraction: float | None
    schedule_bubble_fraction: float | None  # pipeline: the part its schedule forces
    bubble_fraction_with_stalls: float | None  # pipeline: the same step, stalls as they ran
    bubble_step: dict | None  # pipeline: which step: step, typical, normal_steps, metered, stalls
    history: list[StepRecord]  # every step record of this rank, in step order
    machine: MachineUsage  # the host over the steps: the timings' verdict reads it
    # a mixture of experts: the run's tokens per expert per layer on this rank (the
    # steps' `StepRecord.tokens_per_expert` summed); None for a model without routers
    tokens_per_expert: dict[str, list[int]] | None


class ResultRank(_Ranked, ModelStates):
    """One entry of ``Run.result()["ranks"]`` and ``nbpar train --json`` (the contract):
    a `RankResult`'s figures, without its history and machine."""

    peak_bytes: int
    comm_bytes: int | None  # ring bytes: a rank sends under the ring algorithm, at the c10d call
    comm_bytes_by_op: dict[str, int] | None
    comm_s: float | None
    exposed_comm_s: float | None
    comm_wait_s: float | None
    activation_bytes: int | None
    process_peak_bytes: int
    # the rank's shares of its metered steps (added after the first keys, not among them)
    comm_fraction: float
    exposed_comm_fraction: float | None
    comm_wait_fraction: float | None
    comm_fraction_spread: list[float] | None
    exposed_comm_fraction_spread: list[float] | None
    comm_wait_fraction_spread: list[float] | None
    comm_metered_steps: int
    # the rank's blocked share of its normal steps (added after the keys above)
    comm_blocked_fraction: float | None
    comm_blocked_fraction_spread: list[float] | None
    comm_blocked_steps: int
    comm_blocked_method: str | None
    # a mixture of experts: the run's tokens per expert per layer on this rank, else None
    tokens_per_expert: dict[str, list[int]] | None


def result_rank(res: RankResult) -> ResultRank:
    """The contract's entry for one rank, its keys in `ResultRank`'s order."""
    return {key: res[key] for key in ResultRank.__annotations__}


def routing_total(records) -> dict[str, list[int]] | None:
    """The records' ``tokens_per_expert`` summed, per layer and expert (None if none
    has them)."""
    total: dict[str, list[int]] = {}
    for rec in records:
        for layer, counts in (rec.get("tokens_per_expert") or {}).items():
            have = total.setdefault(layer, [0] * len(counts))
            total[layer] = [a + b for a, b in zip(have, counts)]
    return total or None


def routing_imbalance(routing: dict[str, list[int]] | None) -> float | None:
    """How unevenly tokens reach the experts: the busiest expert's tokens over the mean
    expert's, in the layer where that ratio is highest (1 = even; E = every token to one
    expert); None without routing or tokens."""
    ratios = [max(c) * len(c) / sum(c) for c in (routing or {}).values() if sum(c) > 0]
    return max(ratios) if ratios else None


def model_states(rec) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes of a record or result row (missing: 0)."""
    return {PART_NAMES[key]: rec.get(key) or 0 for key in MEMORY_PARTS}


def model_state_bytes(rec) -> int:
    """Params + grads + optimizer state of a record or result row (missing: 0)."""
    return sum(model_states(rec).values())


def memory_key(rec) -> str:
    """What holds a rank's memory: the device allocator on a GPU, the process RSS on CPU
    (the first of `HELD_KEYS` the record measured, a missing or None value is not)."""
    return next((key for key in HELD_KEYS if rec.get(key) is not None), HELD_KEYS[-1])


def held_bytes(rec) -> int | None:
    """The bytes a record says its rank holds (`memory_key`); None when unmeasured."""
    return rec.get(memory_key(rec))
