"""Pipeline timelines: the measured bubble and a Gantt chart of one step.

An event is ``dict(stage, microbatch, kind, start, end)`` (seconds from the step start;
kind "F" or "B", or "I" and "W" for a backward split in two, `KINDS`; pipeline runners add
``rank``, the pp rank that ran it, and ``stall``, see `mark_stalls`). The bubble is the
idle share of the pipeline's devices over the step (GPipe, Huang et al. 2019), every
kind of box counted as work: ``1 - busy / (p * makespan)``; theory says (p-1)/(m+p-1)
(the zero-bubble schedules' formulas: `bubble_formulas`). `StepTimelines` picks the
typical step of a run to draw.
Only matplotlib is imported here, lazily, so this module is cheap to import.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

# a run's first steps carry one-off set-up (for a pipeline: stage shapes inferred,
# buffers allocated); the rule is the loop's, in one place
from nbpar.measure.step_split import SETUP_STEPS

F_COLOR, B_COLOR, STALL_COLOR = "#4C72B0", "#DD8452", "#C44E52"
I_COLOR, W_COLOR = "#8172B3", "#55A868"
#: a box's kind: a forward, a full backward, or a backward split in two (Qi et al. 2023):
#: the input gradient (what the stage below waits for) and the weight gradient (deferrable)
KINDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
COLORS = {"F": F_COLOR, "B": B_COLOR, "I": I_COLOR, "W": W_COLOR}
#: the kinds that hand a gradient to the stage below
GRAD_KINDS = ("B", "I")

#: A box lasting more than STALL_FACTOR x the median of its stage's boxes of its kind is
#: a stall (another process took the core, a page fault, the allocator): not the schedule.
STALL_FACTOR = 3.0
#: The normal steps a run's timeline keeps (the latest), and the fewest a typical step
#: is picked from before it is called typical.
KEEP_STEPS, MIN_STEPS = 15, 5


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


def _length(event: dict) -> float:
    return event["end"] - event["start"]


def _makespan(events: list[dict]) -> float:
    return max(e["end"] for e in events) - min(e["start"] for e in events) if events else 0.0


def mark_stalls(events: list[dict], reference: list[dict] | None = None) -> list[dict]:
    """Copies of ``events``, each with ``stall``: whether it lasted more than
    `STALL_FACTOR` x the median length of the boxes of its stage and kind in
    ``reference`` (default ``events``); a stall also gets ``typical_s``, that median.

    Per stage and kind, not overall: the last stage holds the head and the loss and a
    backward is about two forwards, so one overall median would call a whole slower
    stage a stall. ``reference`` (a runner passes every kept step's boxes) gives a stage
    with one or two micro-batches a median to compare with.
    """
    lengths = defaultdict(list)
    for e in events if reference is None else reference:
        lengths[(e["stage"], e["kind"])].append(_length(e))
    typical = {key: statistics.median(values) for key, values in lengths.items()}
    marked = []
    for e in events:
        median = typical.get((e["stage"], e["kind"]), 0.0)
        stall = median > 0 and _length(e) > STALL_FACTOR * median
        marked.append({**e, "stall": stall, **({"typical_s": median} if stall else {})})
    return marked


def _merged(intervals) -> list[tuple[float, float]]:
    """``intervals`` as sorted disjoint (start, end) pairs, overlaps joined."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def without_stalls(events: list[dict]) -> list[dict]:
    """``events`` with each stall's time past its ``typical_s`` cut from the step, on
    every device: the time axis closes over each cut, so a stall box lasts its typical
    length and the boxes after it move up (boxes overlapping a cut shrink by the overlap).
    What every device waited while one stalled is left out with the stall. Unmarked
    timelines come back as they are."""
    cuts = _merged((e["start"] + e["typical_s"], e["end"]) for e in events if e.get("stall"))
    if not cuts:
        return events

    def moved(t: float) -> float:
        return t - sum(min(b, t) - a for a, b in cuts if t > a)

    return [dict(e, start=moved(e["start"]), end=moved(e["end"])) for e in events]


def bubble_fraction(events: list[dict], p: int, *, with_stalls: bool = False) -> float:
    """Measured idle fraction of ``p`` pipeline devices over the step.

    ``1 - sum(end - start) / (p * makespan)``, makespan = last end - first
    start over all events. 0.0 for an empty timeline. Boxes marked ``stall``
    (`mark_stalls`) are left out (`without_stalls`) unless ``with_stalls``.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if not events:
        return 0.0
    events = events if with_stalls else without_stalls(events)
    busy = sum(_length(e) for e in events)
    makespan = _makespan(events)
    if makespan <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy / (p * makespan)))


def _needs(event: dict, last_stage: int) -> list[tuple]:
    """The boxes ``event`` waits for: F of stage s the F of s-1; B or I (the input
    gradient) of s its own F and the input gradient of s+1 ("G": from s+1's B or I);
    W (the weight gradient) its own I."""
    kind, s, mb = event["kind"], event["stage"], event["microbatch"]
    if kind == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if kind == "W":
        return [("I", s, mb)]
    return [("F", s, mb)] + ([("G", s + 1, mb)] if s < last_stage else [])


def schedule_bubble(events: list[dict], p: int, *, with_stalls: bool = False) -> float:
    """The bubble the schedule itself forces, with the stage times this step measured.

    Replays the step: every rank runs its boxes in the order it ran them, each as long
    as it was measured, and starts each as soon as its rank is free and its inputs
    exist (`_needs`: F of stage s after F of s-1; B or I of s after F of s and B or I
    of s+1; W after its I), with communication and the time between boxes taken as
    zero. (p-1)/(m+p-1) assumes stages of equal length as well; this replay keeps the
    real stage lengths, so ``measured - schedule_bubble`` is what send/recv and
    per-micro-batch work between boxes added, and ``schedule_bubble - theory`` what
    unequal stages added. A lower bound of the measured bubble by construction; stalls
    are left out of both alike (`without_stalls`) unless ``with_stalls``.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if not events:
        return 0.0
    events = events if with_stalls else without_stalls(events)
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
                needs = _needs(e, last_stage)
                if any(n not in done for n in needs):
                    break  # waits for another row's box
                length = e["end"] - e["start"]
                free[row] = max([free[row]] + [done[n] for n in needs]) + length
                done[(e["kind"], e["stage"], e["microbatch"])] = free[row]
                if e["kind"] in GRAD_KINDS:  # the gradient the stage below waits for
                    done[("G", e["stage"], e["microbatch"])] = free[row]
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
    """Gantt chart of one pipeline step: a row per device, a box per pass, coloured by
    kind (`KINDS`: F, B, and a split backward's I and W apart).

    ``ax``: a matplotlib Axes to draw into; without one a new
    ``matplotlib.figure.Figure`` is made (no pyplot state, safe under Agg).
    ``p``/``m`` default to the rows and micro-batches seen in ``events``;
    rows holding several (interleaved) stages label boxes ``stage:microbatch``.
    Boxes marked ``stall`` are hatched with a red edge; the title's bubble leaves
    them out and names the bubble with them. The title compares it with the schedule's
    theory (`theory_title`). Returns the Figure.
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
        color = COLORS[e["kind"]]
        edge = dict(hatch="///", edgecolor=STALL_COLOR, linewidth=1.5) if e.get("stall") else {}
        edge = {"edgecolor": "black", "linewidth": 0.5} | edge
        width = _length(e)
        ax.barh(y, width, left=e["start"], height=0.8, color=color, **edge)
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
    stalls = sum(1 for e in events if e.get("stall"))
    with_stalls = (
        f" ({bubble_fraction(events, p, with_stalls=True):.2f} with {stalls} "
        f"stall{'s' * (stalls > 1)})"
        if stalls
        else ""
    )
    ax.set_title(
        f"bubble measured {bubble_fraction(events, p):.2f}{with_stalls}, "
        f"{theory_title(events, p, m)}"
    )
    from matplotlib.patches import Patch

    seen = {e["kind"] for e in events}
    handles = [Patch(color=COLORS[k], label=f"{KINDS[k]} ({k})") for k in KINDS if k in seen]
    stall = Patch(facecolor="white", edgecolor=STALL_COLOR, hatch="///", label="stall")
    handles += [stall] if stalls else []
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax.figure


def theory_title(events: list[dict], p: int, m: int) -> str:
    """What the schedule's theory says of this step: (p-1)/(m+p-1) (over v chunks a
    rank); for a split backward (I and W boxes) the formulas in time of 1F1B and ZB-H1
    with this step's mean boxes (`bubble_formulas`) and the schedule's replay."""
    if any(e["kind"] == "W" for e in events):
        from nbpar.measure.bubble_formulas import formula_bubbles

        f = formula_bubbles(events, p, m)
        return (
            f"replayed {schedule_bubble(events, p):.2f}; 1F1B (p-1)(F+I+W) {f['1f1b']:.2f}, "
            f"ZB-H1 (p-1)(F+I-W) {f['zb_h1']:.2f}"
        )
    v = max(1, len({e["stage"] for e in events}) // p)
    formula = "(p-1)/(m+p-1)" if v == 1 else f"(p-1)/({v}m+p-1)"
    return (
        f"the schedule alone {schedule_bubble(events, p):.2f}, "
        f"theory {formula} = {theory_bubble(p, m, v):.2f}"
    )


class StepTimelines:
    """A run's recent step timelines, and its typical step: the one to draw and measure.

    ``add(events, metered=...)`` after every step. The first `SETUP_STEPS` (one-off
    set-up) and metered steps (every op through a Python dispatch mode, several times
    slower) are counted, not kept; the latest `KEEP_STEPS` normal ones are kept.

    The typical step is the kept step whose makespan is closest to their median (the
    later on a tie), rather than a step of per-box medians: medians of each box's start
    and end make a step that never ran (a device's boxes may overlap, a box may start
    before its input exists), while the step nearest the median did run, so its boxes,
    its bubble and its Gantt chart agree. Its boxes are marked against every kept step's
    boxes of their stage and kind (`mark_stalls`). Before any normal step it is the
    latest set-up step (``typical`` False in `about`); never a metered step.
    """

    def __init__(self, keep: int = KEEP_STEPS):
        self.normal: deque[tuple[int, list[dict]]] = deque(maxlen=keep)  # (step, events)
        self.setup: tuple[int, list[dict]] | None = None  # the latest set-up step's
        self.metered: deque[int] = deque(maxlen=keep)  # the latest metered steps
        self.steps = 0  # steps added
        self._picked: tuple[int | None, list[dict]] | None = None

    def add(self, events: list[dict], *, metered: bool) -> None:
        """Count one step; keep its ``events`` (copied) if it is a normal one."""
        step, self.steps, self._picked = self.steps, self.steps + 1, None
        if metered:
            self.metered.append(step)
        elif step < SETUP_STEPS:
            self.setup = (step, list(events))
        else:
            self.normal.append((step, list(events)))

    def _pick(self) -> tuple[int | None, list[dict]]:
        if self._picked is None:
            if not self.normal:
                step, events = self.setup or (None, [])
                self._picked = (step, mark_stalls(events))
            else:
                spans = [_makespan(events) for _, events in self.normal]
                median = statistics.median(spans)
                i = min(range(len(spans)), key=lambda i: (abs(spans[i] - median), -i))
                step, events = self.normal[i]
                reference = [e for _, kept in self.normal for e in kept]
                self._picked = (step, mark_stalls(events, reference))
        return self._picked

    def typical(self) -> list[dict]:
        """The typical step's events, each marked ``stall`` True or False."""
        return list(self._pick()[1])

    def about(self) -> dict:
        """Which step `typical` is: ``step`` (steps counted from 0 as added; None before
        any), ``typical`` (picked from at least `MIN_STEPS` normal steps), ``normal_steps``
        (how many it was picked from), ``metered`` (the latest metered steps), ``stalls``."""
        step, events = self._pick()
        return {
            "step": step,
            "typical": len(self.normal) >= MIN_STEPS,
            "normal_steps": len(self.normal),
            "metered": list(self.metered),
            "stalls": sum(e["stall"] for e in events),
        }
