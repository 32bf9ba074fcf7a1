"""What the machine did while a run trained, and whether its time figures can be trusted.

Memory and bytes are exact wherever they are measured; a time is only as good as the
cores it ran on. Each rank notes its host's state over its steps (`usage`): the CPU
seconds its own process got, the CPU seconds the whole host was busy, the wall time, its
cores and torch threads. `timing_verdict` reads those of every rank: when the engines
asked for more threads than the host has cores, when other processes took a fifth of
the cores or more, or when the steps' times spread widely around their median, the
run's timings are marked unreliable, in one line that says why.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

#: other processes' share of a host's cores above which timings are not trusted
OTHERS_LIMIT = 0.2
#: (p75 - p25) / median of the step times above which they are not trusted
SPREAD_LIMIT = 0.25
#: steps a spread needs before it counts (the first two carry one-off set-up)
SPREAD_MIN_STEPS = 5
EXACT = "memory and bytes are exact"


def _busy_seconds() -> float:
    """CPU seconds the whole host has been busy (every core, all processes)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_seconds() -> float:
    """CPU seconds this process has had (all its threads)."""
    t = os.times()
    return t.user + t.system


def snapshot() -> dict:
    """The clocks `usage` takes differences of."""
    return {"wall": time.monotonic(), "own": _own_seconds(), "busy": _busy_seconds()}


def usage(start: dict, threads: int) -> dict:
    """This rank's host state since ``start`` (a `snapshot`): ``host``, ``cores``,
    ``threads`` (torch's intra-op threads), ``wall_s``, ``cpu_s`` (this process) and
    ``host_busy_s`` (the whole host)."""
    end = snapshot()
    return {
        "host": socket.gethostname(),
        "cores": os.cpu_count() or 1,
        "threads": threads,
        "wall_s": end["wall"] - start["wall"],
        "cpu_s": end["own"] - start["own"],
        "host_busy_s": end["busy"] - start["busy"],
    }


def step_spread(step_times: list[float]) -> float | None:
    """(p75 - p25) / median of ``step_times``; None with fewer than `SPREAD_MIN_STEPS`."""
    if len(step_times) < SPREAD_MIN_STEPS:
        return None
    q1, median, q3 = statistics.quantiles(step_times, n=4)
    return (q3 - q1) / median if median > 0 else None


def _host_reasons(ranks: list[dict]) -> tuple[list[str], float]:
    """Why one host's timings cannot be trusted ([] when they can), and the share of its
    cores that processes other than the engines took."""
    cores = ranks[0]["cores"]
    threads = sum(r["threads"] for r in ranks)
    wall = max(r["wall_s"] for r in ranks)
    others = max(r["host_busy_s"] for r in ranks) - sum(r["cpu_s"] for r in ranks)
    share = max(0.0, others) / (wall * cores) if wall > 0 else 0.0
    reasons = []
    if threads > cores:
        reasons.append(f"{len(ranks)} engines x {ranks[0]['threads']} threads shared {cores} cores")
    if share > OTHERS_LIMIT:
        reasons.append(f"other processes took {share:.0%} of the {cores} cores")
    return reasons, share


def timing_verdict(machines: list[dict], spread: float | None) -> tuple[bool, str]:
    """(reliable, the one line that says so) for a run whose ranks noted ``machines``
    (`usage` per rank) and whose normal steps spread by ``spread`` (`step_spread`)."""
    by_host: dict[str, list[dict]] = {}
    for m in machines:
        by_host.setdefault(m["host"], []).append(m)
    reasons, shares = [], []
    for ranks in by_host.values():
        found, share = _host_reasons(ranks)
        reasons += found
        shares.append(share)
    if spread is not None and spread > SPREAD_LIMIT:
        reasons.append(f"step times spread {spread:.0%} around their median")
    if reasons:
        return False, f"timings unreliable: {'; '.join(reasons)}; {EXACT}"
    said = f"other processes took {max(shares, default=0.0):.0%} of the cores"
    if spread is not None:
        said += f", step times within {spread:.0%} of their median"
    return True, f"timings reliable here: {said}; {EXACT}"
