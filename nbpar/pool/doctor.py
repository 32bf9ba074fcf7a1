"""The hang doctor: where every rank is, and which one went its own way.

``pool.doctor()`` (``%dist doctor``, and every timeout) asks each engine's side
thread (`nbpar.pool.snapshot`) through the rendezvous store for its Python stack
and recent collectives, then compares them: a rank in a different collective, or
in none, while its peers wait, is named with its cell line, e.g. "rank 1 is at
cell line 3 (time.sleep(60)), not in a collective (last: all_reduce #1); rank 0
waits in all_reduce #2 (cell line 4)". Ranks that disagree on the op or the
shapes of one collective are named too.
"""

from __future__ import annotations

import html
import json
import time

from nbpar.errors import PoolError
from nbpar.pool.snapshot import KEY

#: Seconds to wait for the ranks' answers.
ANSWER_S = 3.0


def _names(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _verb(ranks, one: str, many: str) -> str:
    return f"{_names(ranks)} {one if len(list(ranks)) == 1 else many}"


def _shape(c: dict) -> str:
    shapes = c["shapes"]
    return str(shapes[0] if len(shapes) == 1 else shapes)


def _op(c: dict) -> str:
    group = "" if c["group"] == "default" else f" (group {c['group']})"
    return f"{c['op']} #{c['seq']}{group}"


def _at(rep: dict) -> str:
    w = rep.get("where")
    if not w:
        return "idle"
    place = f"cell line {w['line']}" if w["cell"] else f"{w['file']}:{w['line']}"
    return f"{place}: {w['code']}" if w["code"] else place


def _last(rep: dict) -> str:
    return f"last: {_op(rep['collectives'][-1])}" if rep["collectives"] else "no collective yet"


def _mismatch(reports: dict) -> str | None:
    """The first collective (group, seq) that ranks recorded with different ops or shapes."""
    seen: dict = {}
    for r, rep in sorted(reports.items()):
        for c in rep["collectives"]:
            seen.setdefault((c["group_id"], c["seq"]), {})[r] = c
    for (_, _), by_rank in sorted(seen.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if len(by_rank) < 2:
            continue
        first = next(iter(by_rank.values()))
        if len({c["op"] for c in by_rank.values()}) > 1:
            calls = "; ".join(f"rank {r} calls {c['op']}" for r, c in by_rank.items())
            return f"ranks disagree on collective #{first['seq']}: {calls}"
        if len({json.dumps(c["shapes"]) for c in by_rank.values()}) > 1:
            shapes = ", ".join(f"rank {r} {_shape(c)}" for r, c in by_rank.items())
            stuck = [r for r, c in by_rank.items() if c["state"] != "completed"]
            return f"{_op(first)} has different shapes on different ranks: {shapes}" + (
                f"; {_names(stuck)} still in it" if stuck else ""
            )
    return None


def diagnose(reports: dict, ranks) -> str:
    """One line: which rank diverged, and where each group of ranks is."""
    missing = [r for r in ranks if r not in reports]
    reports = {r: rep for r, rep in reports.items() if "error" not in rep}
    if (mismatch := _mismatch(reports)) is not None:
        return mismatch
    waiting = {r: rep for r, rep in reports.items() if rep["state"] == "in collective"}
    others = {r: rep for r, rep in reports.items() if r not in waiting}
    lines = []
    if missing:
        lines.append(
            f"{_verb(missing, 'did', 'did')} not answer (dead, or holding the GIL in native code)"
        )
    if waiting and others:
        lines += [
            f"rank {r} is not in a collective, at {_at(rep)} ({_last(rep)})"
            for r, rep in others.items()
        ]
    groups: dict = {}
    for r, rep in waiting.items():
        c = rep["waiting_in"]
        groups.setdefault(_op(c) if c else "a collective", []).append(r)
    if len(groups) > 1:  # the smaller, then the earlier, groups diverged
        order = sorted(
            groups,
            key=lambda k: (
                len(groups[k]),
                waiting[groups[k][0]]["waiting_in"]["seq"]
                if waiting[groups[k][0]]["waiting_in"]
                else 0,
            ),
        )
        *diverged, main = order
        lines += [
            f"{_verb(groups[k], 'is', 'are')} at {k} ({_at(waiting[groups[k][0]])})"
            for k in diverged
        ]
        lines.append(f"{_verb(groups[main], 'waits', 'wait')} in {main}")
    elif groups:
        ((k, rs),) = groups.items()
        lines.append(
            f"{_verb(rs, 'waits', 'wait')} in {k} ({_at(waiting[rs[0]])})"
            + (
                ""
                if others or missing
                else ": every rank is in it, so the wait is "
                "in the network or a slow rank, not a missing call"
            )
        )
    if not waiting and not missing:
        running = {r: rep for r, rep in others.items() if rep["state"] == "running"}
        if not running:
            return "every rank is idle: nothing is stuck"
        lines.append(
            "no rank is in a collective: "
            + "; ".join(f"rank {r} at {_at(rep)}" for r, rep in running.items())
        )
    return "; ".join(lines)


class DoctorReport:
    """Every rank's state, stack and recent collectives, with a one-line diagnosis."""

    def __init__(self, reports: dict, ranks, backend: str, dead=()):
        self.reports = dict(sorted(reports.items()))
        self.ranks, self.backend, self.dead = list(ranks), backend, list(dead)
        self.diagnosis = diagnose(self.reports, self.ranks)
        self.way_out = "run `%dist restart` (pool.restart()) to get fresh engines" + (
            ", or pool.doctor(abort=True) to abort the nccl communicators so the cells end"
            if backend == "nccl"
            else " (gloo cannot abort a collective)"
        )

    def lines(self, frames: int = 6) -> list[str]:
        out = [f"diagnosis: {self.diagnosis}", f"way out: {self.way_out}"]
        hosts = len({rep.get("host") for rep in self.reports.values()})
        for r in self.ranks:
            rep = self.reports.get(r)
            if rep is None:
                out.append(f"rank {r}: {'dead' if r in self.dead else 'no answer'}")
                continue
            if "error" in rep:
                out.append(f"rank {r}: could not look: {rep['error']}")
                continue
            at = "" if rep["state"] == "idle" else f", at {_at(rep)}"
            where = f"pid {rep['pid']}" + (f" on {rep['host']}" if hosts > 1 else "")
            out.append(f"rank {r} ({where}): {rep['state']}{at}")
            for c in rep["collectives"][-5:]:
                out.append(f"    {_op(c):<28} {_shape(c):<20} {c['state']}")
            for f in rep["stack"][-frames:]:
                out.append(f"    {f['file']}:{f['line']} in {f['function']}: {f['code']}")
        return out

    def __str__(self):
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_html_(self):
        return "<pre class='nbpar-doctor'>" + html.escape(str(self)) + "</pre>"


class Question:
    """The doctor's request, sent to the ranks at once; `report` collects the answers
    (each rank's side thread answers within about `snapshot.POLL_S`)."""

    def __init__(self, pool, ranks=None, abort: bool = False):
        self.pool = pool
        self.ranks = list(range(pool.n)) if ranks is None else list(ranks)
        self.dead = pool.dead_ranks()
        self.reports: dict = {}
        self.keys: dict = {}
        if 0 not in self.dead:  # rank 0's engine serves the store
            self.store = pool.store()
            n = self.store.add(f"{KEY}/seq", 1)
            self.store.set(f"{KEY}/req/{n}", "abort" if abort else "look")
            self.keys = {r: f"{KEY}/rep/{n}/{r}" for r in self.ranks if r not in self.dead}

    def report(self, timeout: float = ANSWER_S) -> DoctorReport:
        """The answers that arrive within ``timeout`` seconds (all of them, or fewer)."""
        deadline = time.monotonic() + timeout
        while self.keys:
            for r, key in list(self.keys.items()):
                if self.store.check([key]):
                    self.reports[r] = json.loads(self.store.get(key))
                    del self.keys[r]
            if not self.keys or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return DoctorReport(self.reports, self.ranks, self.pool.backend, self.dead)


def ask(pool, ranks=None, timeout: float = ANSWER_S, abort: bool = False) -> DoctorReport:
    """Ask every rank where it is, through the rendezvous store (works across hosts)."""
    return Question(pool, ranks, abort).report(timeout)


def doctor(pool, abort: bool = False) -> DoctorReport:
    """``pool.doctor()``: only while a cell or a run is in progress."""
    if abort and pool.backend != "nccl":
        raise ValueError(
            f"abort=True needs nccl; {pool.backend} cannot abort a collective: run pool.restart()"
        )
    if not pool.busy_ranks():
        raise PoolError(
            "nothing is running on the pool: the doctor looks at ranks while a "
            "cell or a run is in progress (or stuck)"
        )
    report = ask(pool, abort=abort)
    pool.prepare_restart()  # the doctor's way out is a restart: warm engines for it
    return report
