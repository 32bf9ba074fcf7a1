"""How a metered step's communication divides that step: the shares a run reports and the
dashboard draws. Imports nothing, so the kernel's view can use it without torch.

Each share is measured seconds over the metered step's own seconds (`CommMeter.window_s`),
never scaled to another step nor capped: ``exposed`` (no compute ran, every rank had
joined) and ``wait`` (no compute ran, a rank had not joined yet) are disjoint parts of the
time in flight, which lies inside the step, so exposed + wait <= in flight <= 1 holds
because it was measured so. The metered step runs slower than a normal one (every op
passes through Python, which stretches compute and not the collectives), so these are
shares of that step: they rank strategies by how much they communicate, and a normal
step would show a larger share of communication.
"""

from __future__ import annotations

import statistics

SHARES = ("comm_fraction", "exposed_comm_fraction", "comm_wait_fraction")
#: Steps at the start of a run left out of its blocked share (one-off set-up: FSDP's lazy
#: init, DDP's bucket rebuild)
SETUP_STEPS = 2
SECONDS = ("comm_in_flight_s", "exposed_comm_s", "comm_wait_s")


def step_shares(record: dict) -> tuple[float, float, float] | None:
    """(in flight, exposed, wait) of one metered step record as shares of that step, or
    None for a record that was not metered (or has no window: an older record)."""
    window = record.get("comm_window_s")
    if not record.get("comm_metered") or not window or window <= 0:
        return None
    return tuple((record.get(key) or 0.0) / window for key in SECONDS)


def share_summary(records: list[dict]) -> dict:
    """The median of each share over the metered steps among ``records``, and its spread
    (``<share>_spread``: [lowest, highest]); None for each when none was metered."""
    rows = [s for s in (step_shares(r) for r in records) if s is not None]
    out: dict = {}
    for i, key in enumerate(SHARES):
        values = [row[i] for row in rows]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_spread"] = [min(values), max(values)] if values else None
    out["comm_metered_steps"] = len(rows)
    return out


def normal_steps(records: list[dict]) -> list[dict]:
    """One rank's ``records`` (in step order) that are normal steps: the first
    `SETUP_STEPS` (one-off set-up) and the metered ones (slower) left out."""
    return [r for r in records[SETUP_STEPS:] if not r.get("comm_metered")]


def normal_step_times(records: list[dict]) -> list[float]:
    """The seconds of each of one rank's `normal_steps`."""
    return [r["step_time_s"] for r in normal_steps(records)]


def blocked_shares(records: list[dict]) -> list[float]:
    """Each normal step's seconds blocked on communication over its own seconds
    (`nbpar.measure.blocked`), for one rank's ``records`` in step order: the first
    `SETUP_STEPS` and the metered steps left out, and steps without the clock (a GPU)."""
    return [
        r["comm_blocked_s"] / r["step_time_s"]
        for r in normal_steps(records)
        if r.get("comm_blocked_s") is not None and r.get("step_time_s", 0) > 0
    ]


def blocked_share(records: list[dict]) -> float | None:
    """The median of `blocked_shares` (None when no step had the clock)."""
    shares = blocked_shares(records)
    return statistics.median(shares) if shares else None
