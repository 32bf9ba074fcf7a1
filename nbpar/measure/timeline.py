"""Pipeline timelines: the measured bubble and a Gantt chart of one step.

An event is ``dict(stage, microbatch, kind "F"|"B", start, end)`` (seconds from
the step start; pipeline runners add ``rank``, the pp rank that ran it). The
bubble is the idle share of the pipeline's devices over the step (GPipe,
Huang et al. 2019): ``1 - busy / (p * makespan)``; theory says (p-1)/(m+p-1).
Only matplotlib is imported here, lazily, so this module is cheap to import.
"""

from __future__ import annotations

from collections import defaultdict

F_COLOR, B_COLOR = "#4C72B0", "#DD8452"


def theory_bubble(p: int, m: int, v: int = 1) -> float:
    """Ideal bubble fraction for ``p`` devices and ``m`` micro-batches.

    GPipe/1F1B: (p-1)/(m+p-1); with ``v`` interleaved chunks per device the
    fill and drain shrink v-fold (Megatron-LM 2021): (p-1)/(v*m+p-1).
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def _row(event: dict) -> int:
    """The device row of an event: its pp rank if known, else its stage."""
    return event.get("rank", event["stage"])


def bubble_fraction(events: list[dict], p: int) -> float:
    """Measured idle fraction of ``p`` pipeline devices over the step.

    ``1 - sum(end - start) / (p * makespan)``, makespan = last end - first
    start over all events. 0.0 for an empty timeline.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if not events:
        return 0.0
    busy = sum(e["end"] - e["start"] for e in events)
    makespan = max(e["end"] for e in events) - min(e["start"] for e in events)
    if makespan <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy / (p * makespan)))


def schedule_bubble(events: list[dict], p: int) -> float:
    """The bubble the schedule itself forces, with the stage times this step measured.

    Replays the step: every rank runs its F and B boxes in the order it ran them, each
    as long as it was measured, and starts each as soon as its rank is free and its
    inputs exist (F of stage s after F of s-1; B of s after F of s and B of s+1), with
    communication and the time between boxes taken as zero. (p-1)/(m+p-1) assumes
    stages of equal length as well; this replay keeps the real stage lengths, so
    ``measured - schedule_bubble`` is what send/recv and per-micro-batch work between
    boxes added, and ``schedule_bubble - theory`` what unequal stages added. A lower
    bound of the measured bubble by construction.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if not events:
        return 0.0
    order: dict[int, list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["start"]):
        order[_row(e)].append(e)
    last_stage = max(e["stage"] for e in events)
    done: dict[tuple, float] = {}
    at = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    busy = 0.0
    progressed = True
    while progressed:
        progressed = False
        for row, queue in order.items():
            while at[row] < len(queue):
                e = queue[at[row]]
                s, mb = e["stage"], e["microbatch"]
                needs = [("F", s - 1, mb)] if e["kind"] == "F" and s > 0 else []
                if e["kind"] == "B":
                    needs = [("F", s, mb)] + ([("B", s + 1, mb)] if s < last_stage else [])
                if any(n not in done for n in needs):
                    break  # waits for another row's box
                length = e["end"] - e["start"]
                free[row] = max([free[row]] + [done[n] for n in needs]) + length
                done[(e["kind"], s, mb)] = free[row]
                busy += length
                at[row] += 1
                progressed = True
    if any(at[row] < len(q) for row, q in order.items()):
        raise ValueError(
            "the timeline's boxes cannot be replayed: a box waits for one that never ran"
        )
    makespan = max(done.values())
    return min(1.0, max(0.0, 1.0 - busy / (p * makespan))) if makespan > 0 else 0.0


def plot_timeline(events: list[dict], ax=None, *, p: int | None = None, m: int | None = None):
    """Gantt chart of one pipeline step: a row per device, F and B boxes.

    ``ax``: a matplotlib Axes to draw into; without one a new
    ``matplotlib.figure.Figure`` is made (no pyplot state, safe under Agg).
    ``p``/``m`` default to the rows and micro-batches seen in ``events``;
    rows holding several (interleaved) stages label boxes ``stage:microbatch``.
    Returns the Figure.
    """
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=(8, 2.5)).add_subplot()
    rows = sorted({_row(e) for e in events})
    p = p or max(len(rows), 1)
    m = m or len({e["microbatch"] for e in events}) or 1
    stages = {e["stage"] for e in events}
    labels = defaultdict(set)
    for e in events:
        y = rows.index(_row(e))
        labels[y].add(e["stage"])
        color = F_COLOR if e["kind"] == "F" else B_COLOR
        width = e["end"] - e["start"]
        ax.barh(
            y, width, left=e["start"], height=0.8, color=color, edgecolor="black", linewidth=0.5
        )
        text = (
            str(e["microbatch"]) if len(rows) == len(stages) else f"{e['stage']}:{e['microbatch']}"
        )
        ax.text(
            e["start"] + width / 2, y, text, ha="center", va="center", fontsize=7, color="white"
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {','.join(map(str, sorted(labels[y])))}" for y in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since step start")
    v = max(1, len(stages) // p)
    formula = "(p-1)/(m+p-1)" if v == 1 else f"(p-1)/({v}m+p-1)"
    ax.set_title(
        f"bubble measured {bubble_fraction(events, p):.2f}, "
        f"theory {formula} = {theory_bubble(p, m, v):.2f}"
    )
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=F_COLOR, label="forward"), Patch(color=B_COLOR, label="backward")],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    return ax.figure


def clock_offset(group=None, rounds: int = 8) -> float:
    """This rank's ``time.perf_counter()`` minus that of rank 0 of ``group``.

    Processes of one machine share its monotonic clock (perf_counter), so the
    offset is exactly 0 there; across machines it is estimated with
    ``cristian_offset``. Collective over ``group``; lets spans measured in
    different processes share one time axis.
    """
    import torch.distributed as dist

    machines: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, _machine_id(), group=group)
    if len(set(machines)) == 1:
        return 0.0
    return cristian_offset(group, rounds)[0]


def cristian_offset(group=None, rounds: int = 8) -> tuple[float, float]:
    """(clock offset to rank 0 of ``group``, round trip it was measured with).

    Cristian's algorithm: rank 0 pings every peer ``rounds`` times and keeps
    the estimate of the fastest round trip; its error is at most half that
    round trip. Rank 0 itself gets (0.0, 0.0). Collective over ``group``.
    """
    import time

    import torch
    import torch.distributed as dist

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    me, size = dist.get_rank(group), dist.get_world_size(group)
    buf = torch.zeros(2, dtype=torch.float64)
    result = (0.0, 0.0)
    for peer in range(1, size):
        if me == 0:
            best = (float("inf"), 0.0)
            for _ in range(rounds):
                t1 = time.perf_counter()
                dist.send(buf, dst=global_rank(peer), group=group)
                dist.recv(buf, src=global_rank(peer), group=group)
                t2 = time.perf_counter()
                best = min(best, (t2 - t1, buf[0].item() - (t1 + t2) / 2))
            buf[0], buf[1] = best[1], best[0]
            dist.send(buf, dst=global_rank(peer), group=group)
        elif me == peer:
            for _ in range(rounds):
                dist.recv(buf, src=global_rank(0), group=group)
                buf[0] = time.perf_counter()
                dist.send(buf, dst=global_rank(0), group=group)
            dist.recv(buf, src=global_rank(0), group=group)
            result = (buf[0].item(), buf[1].item())
    return result


def _machine_id() -> str:
    """Identifies one booted kernel: processes with equal ids share CLOCK_MONOTONIC."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()
