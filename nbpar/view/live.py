"""What the live dashboard draws: one row per step that every rank has finished.

`LiveFeed` reads a run's step records as they arrive and returns only the steps that
are new since the last read, as columns for `nbpar.view.livechart.LiveChart`. Lines
are per rank only where ranks differ: each rank's loss on its replica's micro-batches
(``local_loss``, when the records carry it), step and communication time, memory.
The loss every rank reports after averaging is one line. Model states (params +
grads + optimizer) get their own panel, in their own scale, beside the process memory
they live in.
"""

from __future__ import annotations

from nbpar.estimate import format_bytes
from nbpar.measure.machine import EXACT, SPREAD_LIMIT, SPREAD_MIN_STEPS, step_spread
from nbpar.measure.records import (
    memory_key,
    model_state_bytes,
    model_states,
    routing_imbalance,
    routing_total,
)
from nbpar.measure.step_split import SETUP_STEPS, blocked_share, normal_step_times
from nbpar.view.history import COMM_HEALTH, comm_split

WAITING = "waiting for the first step"
#: matplotlib's tab10, so the live chart and the static figures colour ranks alike
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
TITLES = {
    "loss": "loss",
    "step": "step time per rank",
    "comm": "exposed communication per rank (latest metered step)",
    "throughput": "throughput",
    "states": "model states per rank (params + grads + optimizer)",
    "process": "process memory per rank",
    # a mixture of experts only
    "routing": "routing imbalance per rank (busiest expert's tokens / mean expert's)",
}


def rank_color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def waiting_spec() -> dict:
    """Panels with titles and no series: the browser says "waiting for the first step"
    (a mixture of experts' routing panel comes with its first step)."""
    return {
        "waiting": WAITING,
        "panels": [
            {"id": k, "title": t, "unit": "", "series": []}
            for k, t in TITLES.items()
            if k != "routing"
        ],
    }


def global_loss(recs: list[dict]):
    """The run's loss at one step: every rank reports the averaged loss; a pipeline's last
    stage is the one that computed it, so read from the last rank backwards."""
    for rec in reversed(recs):
        if rec.get("loss") is not None:
            return rec["loss"]
    return None


def _series(label: str, i: int, light: bool = False, **style) -> dict:
    """Rank ``i``'s colour; ``light``: half transparent (solid lines: dashes of a long
    path cost the browser far more to draw)."""
    return {"label": label, "color": rank_color(i) + ("80" if light else ""), **style}


def nested_widths(n: int, base: float = 1.5, extra: float = 4.5) -> list[float]:
    """Line widths for ``n`` ranks drawn in rank order: each a little thinner than the one
    below it (rank 0 widest, the last rank ``base``), so lines that coincide (ranks
    holding the same states, a tp group's shared loss) show every colour as a stripe
    rather than the last rank hiding rank 0. At most ``extra`` pixels wider in all."""
    step = min(1.5, extra / (n - 1)) if n > 1 else 0.0
    return [round(base + step * (n - 1 - i), 2) for i in range(n)]


def _rank_series(ranks: list[int], fmt: str = "rank {}", base: float = 1.5, **style) -> list:
    """One series per rank, ``nested_widths`` apart."""
    widths = nested_widths(len(ranks), base)
    return [
        _series(fmt.format(r), i, width=w, **style) for i, (r, w) in enumerate(zip(ranks, widths))
    ]


def build_spec(ranks: list[int], first: list[dict]) -> dict:
    """The panels for this run, decided by its first complete step (never changed later,
    so units do not jump): local losses if recorded, tokens/s or samples/s, RSS or
    device memory."""
    local = any(r.get("local_loss") is not None for r in first)
    tokens = any(r.get("tokens_per_s") is not None for r in first)
    device = memory_key(first[0]) == "device_allocated_bytes"
    loss = [{"label": "loss (mean over ranks)", "color": "#222222", "width": 2.5}]
    if local:
        loss += _rank_series(ranks, "rank {} replica batch", base=1, light=True)
    unit = "tokens/s" if tokens else "samples/s"
    mem = "device memory per rank (allocated)" if device else "process memory per rank (RSS)"
    panels = [
        {"id": "loss", "title": TITLES["loss"], "unit": "", "series": loss},
        {"id": "step", "title": TITLES["step"], "unit": "s", "series": _rank_series(ranks)},
        {"id": "comm", "title": TITLES["comm"], "unit": "s", "series": _rank_series(ranks)},
        {
            "id": "throughput",
            "title": f"throughput ({unit})",
            "unit": unit,
            "series": [{"label": "whole run", "color": "#9467bd", "width": 2}],
        },
        {
            "id": "states",
            "title": TITLES["states"],
            "unit": "B",
            "series": _rank_series(ranks),
        },
        {
            "id": "process",
            "title": mem,
            "unit": "B",
            "series": _rank_series(ranks),
        },
    ]
    routing = any(r.get("tokens_per_expert") for r in first)
    if routing:
        panels.append(
            {"id": "routing", "title": TITLES["routing"], "unit": "", "series": _rank_series(ranks)}
        )
    return {
        "waiting": WAITING,
        "panels": panels,
        "routing": routing,
        "local_loss": local,
        "throughput_key": "tokens_per_s" if tokens else "samples_per_s",
        "memory_key": memory_key(first[0]),
    }


#: what a rank's blocked share needs of each record (kept, not the whole record)
BLOCKED_KEYS = ("step_time_s", "comm_blocked_s", "comm_metered")


class LiveFeed:
    """New complete steps of a run, as chart columns; ``notes`` say the latest numbers."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self.spec: dict | None = None
        self._last = {r: None for r in self.ranks}  # last step read per rank
        self._pending: dict[int, dict[int, dict]] = {}
        self._metered: dict[int, dict] = {}  # rank -> its latest metered step record
        # rank -> its step records' blocked seconds and step seconds (for its blocked share)
        self._normal: dict[int, list[dict]] = {r: [] for r in self.ranks}
        self._peak = dict.fromkeys(self.ranks, 0)
        self.latest: dict[int, dict] = {}
        self.times: tuple | None = None  # (first, latest) record time read
        #: the run's (reliable, line) about its timings once it ended (`Run.timing_verdict`)
        self.verdict: tuple[bool, str] | None = None

    def _new_records(self, history: list[dict]) -> list[dict]:
        out = [
            rec
            for rec in history
            if rec["rank"] in self._last
            and (self._last[rec["rank"]] is None or rec["step"] > self._last[rec["rank"]])
        ]
        for rec in out:
            last = self._last[rec["rank"]]
            self._last[rec["rank"]] = rec["step"] if last is None else max(last, rec["step"])
        return out

    def read(self, history: list[dict]) -> tuple[list[int], dict[str, list[list]], dict | None]:
        """(steps, columns per panel, the spec if it is new) for steps finished since the
        last read by every rank."""
        for rec in self._new_records(history):
            self._pending.setdefault(rec["step"], {})[rec["rank"]] = rec
        complete = sorted(s for s, recs in self._pending.items() if len(recs) == len(self.ranks))
        steps = []
        for s in complete:
            recs = self._pending.pop(s)
            steps.append([recs[r] for r in self.ranks])
        new_spec = None
        if steps and self.spec is None:
            self.spec = new_spec = build_spec(self.ranks, steps[0])
        cols = {p["id"]: [[] for _ in p["series"]] for p in (self.spec or {"panels": []})["panels"]}
        for recs in steps:
            self._add_row(cols, recs)
        return complete, cols, new_spec

    def _add_row(self, cols: dict, recs: list[dict]) -> None:
        spec = self.spec
        loss = [global_loss(recs)]
        if spec["local_loss"]:
            loss += [r.get("local_loss") for r in recs]
        for rank, rec in zip(self.ranks, recs):
            if rec.get("comm_metered"):
                self._metered[rank] = rec
            self._normal[rank].append({k: rec.get(k) for k in BLOCKED_KEYS})
        # communication as the latest metered step measured it, carried forward
        exposed = [(self._metered.get(r) or {}).get("exposed_comm_s") for r in self.ranks]
        rates = [r.get(spec["throughput_key"]) for r in recs]
        rates = [v for v in rates if v is not None]
        row = {
            "loss": loss,
            "step": [r.get("step_time_s") for r in recs],
            "comm": exposed,
            "throughput": [min(rates) if rates else None],
            "states": [model_state_bytes(r) for r in recs],
            "process": [r.get(spec["memory_key"]) for r in recs],
        }
        if spec["routing"]:
            row["routing"] = [routing_imbalance(r.get("tokens_per_expert")) for r in recs]
        for panel, values in row.items():
            for col, value in zip(cols[panel], values):
                col.append(value)
        for rank, rec in zip(self.ranks, recs):
            self.latest[rank] = rec
            if rec.get("time") is not None:
                first = self.times[0] if self.times else rec["time"]
                self.times = (first, max(rec["time"], self.times[1] if self.times else 0))
            self._peak[rank] = max(
                self._peak[rank], rec.get(spec["memory_key"]) or 0, rec.get("peak_bytes") or 0
            )

    def _blocked(self, rank: int) -> float | None:
        """The rank's blocked share of a normal step so far (`step_split.blocked_share`)."""
        return blocked_share(self._normal[rank])

    def timing(self) -> tuple[bool, str | None]:
        """(reliable, the line that says why) for the time figures so far: the run's own
        verdict once it ended (``verdict``, `Run.timing_verdict`: the hosts' load and the
        steps' spread); while it trains, the spread of each rank's normal steps (no line
        before there are enough of them)."""
        if self.verdict is not None:
            return self.verdict
        spreads = [step_spread(normal_step_times(self._normal[r])) for r in self.ranks]
        spreads = [x for x in spreads if x is not None]
        if not spreads:
            return True, None
        spread = max(spreads)
        if spread > SPREAD_LIMIT:
            return False, (
                f"timings unreliable so far: step times spread {spread:.0%} around their "
                f"median; {EXACT}"
            )
        return True, (
            f"step times within {spread:.0%} of their median so far (the machine's load "
            "is judged when the run ends)"
        )

    def notes(self) -> dict[str, str]:
        """One line under each panel with the latest numbers (empty before the first step)."""
        if not self.latest:
            return {}
        spec, ranks = self.spec, [r for r in self.ranks if r in self.latest]
        shares = {}
        for r in ranks:
            if r in self._metered:
                exposed, _, _, step = comm_split([self._metered[r]])
                shares[r] = exposed / step if step > 0 else 0.0
        blocked = {r: self._blocked(r) for r in ranks}
        blocked = {r: b for r, b in blocked.items() if b is not None}
        judged = blocked or shares  # every step's figure where there is one
        busy = [r for r, s in judged.items() if s > COMM_HEALTH]
        comm = " · ".join(f"rank {r} {s:.0%}" for r, s in shares.items()) or "not metered yet"
        if blocked:
            comm = (
                "blocked on communication in a normal step (every step): "
                + " · ".join(f"rank {r} {b:.0%}" for r, b in blocked.items())
                + f"; exposed share of the metered step: {comm}"
            )
        else:
            comm = f"exposed share of the metered step: {comm}"
        reliable, timing = self.timing()
        if busy:  # the rule of thumb, unless this machine's timings cannot carry it
            comm += (
                f" (above {COMM_HEALTH:.0%}: worth a look)"
                if reliable
                else (f" (above {COMM_HEALTH:.0%}, but {timing})")
            )
        states = " · ".join(
            f"rank {r}: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in model_states(self.latest[r]).items())
            for r in ranks
        )
        loss = (
            "dark: the loss averaged over ranks; light: each rank's loss on its data-parallel "
            "replica's micro-batches (the ranks of one tp group or pipeline share a replica, "
            "so their lines coincide)"
            if spec["local_loss"]
            else "the loss averaged over ranks (every rank reports this same value)"
        )
        rate = self.latest[ranks[-1]].get(spec["throughput_key"])
        notes = {
            "loss": loss,
            "step": timing
            or "each rank's step; whether its timings can be trusted shows "
            f"after {SETUP_STEPS + SPREAD_MIN_STEPS} steps",
            "comm": comm,
            "throughput": "the whole run's rate, set by the slowest rank"
            + (f"; latest {rate:,.0f} {spec['throughput_key'][:-6]}/s" if rate else ""),
            "states": states,
            "process": "peak: "
            + " · ".join(f"rank {r} {format_bytes(self._peak[r])}" for r in ranks),
        }
        if spec["routing"]:
            notes["routing"] = routing_note([self.latest[r] for r in ranks])
        return notes


def routing_note(recs: list[dict]) -> str:
    """The latest step's tokens per expert, all ranks' summed, in the most uneven layer
    (what each expert computed), and what the panel's ratio means."""
    total = routing_total(recs) or {}
    if not total:
        return "no routing recorded"
    layer = max(total, key=lambda k: routing_imbalance({k: total[k]}) or 0.0)
    counts = " ".join(str(c) for c in total[layer])
    return (
        f"latest step, all ranks' tokens per expert in layer {layer}: {counts}; "
        f"the lines: 1 = even, {len(total[layer])} = every token to one expert"
    )
