"""Live word on a ``%%dist`` cell whose ranks came apart: who waits where, while it waits.

A cell that hangs without a ``--timeout`` showed nothing for as long as it hung, and the
kernel, busy waiting, could not run ``%dist doctor``. Now the wait asks the doctor
(`nbpar.pool.doctor`) every `LOOK_S` seconds once the cell has run `WATCH_S`, without
blocking: the question goes out through the rendezvous store on one poll and the answers
are read on later ones. Once the ranks are apart for a look or more (a rank in the same
collective at two looks, some ranks finished while others run, or ranks that disagree on
a collective) the cell's live area (`LiveOutput`) shows, updated in place::

    nbpar, 12 s into the cell: rank 0 waits in all_reduce #2 (cell line 3: ...) for at
    least 4 s; rank 1 is at cell line 2: time.sleep(60), not in a collective
    press the stop button (Kernel > Interrupt) to interrupt ...
    diagnosis: ... (then each rank's collectives and stack, as `%dist doctor` shows them)

The live area is emptied when the cell ends, so no saved notebook keeps it. Without a
live area (a terminal, ``--no-stream``) the first two lines go to stderr, again only when
what they say changes.
"""

from __future__ import annotations

import re
import sys
import time

#: Seconds a cell runs before its ranks are first looked at.
WATCH_S = 4.0
#: Seconds between two looks (a rank in one collective at two looks waited this long).
LOOK_S = 4.0
#: Stack frames per rank shown under the diagnosis.
FRAMES = 4
STOP_HINT = (
    "press the stop button (Kernel > Interrupt, Ctrl-C in a terminal) to interrupt; "
    "a rank blocked in a collective then needs `%dist restart`"
)


def describe(reports: dict, finished, waited: dict, ranks) -> str:
    """One line, rank by rank: finished, waiting in which collective for how long, or
    where it runs. ``waited``: rank -> seconds seen in its current collective."""
    from nbpar.pool.doctor import _at, _op

    parts = []
    for r in ranks:
        rep = reports.get(r)
        if r in finished:
            parts.append(f"rank {r} finished")
        elif rep is None or "error" in rep:
            parts.append(f"rank {r} did not answer")
        elif rep["state"] == "in collective":
            c = rep["waiting_in"]
            what = _op(c) if c else "a collective"
            parts.append(f"rank {r} waits in {what} ({_at(rep)}) for at least {waited[r]:.0f} s")
        else:
            parts.append(f"rank {r} is at {_at(rep)}, not in a collective")
    return "; ".join(parts)


class HangWatch:
    """Looks at a running cell's ranks now and then; `poll` says what to show ('' none)."""

    def __init__(self, pool, ars: dict, doctor_ready, clock=time.monotonic):
        """``doctor_ready(now)``: whether the kernel can ask the doctor now, never waiting
        past ``now`` (`execute._doctor_ready`)."""
        self.pool, self.ars, self.clock = pool, ars, clock
        self.doctor_ready = doctor_ready
        self.start = clock()
        self.next_look = self.start + WATCH_S
        self.question, self.asked_at = None, 0.0
        self.reports: dict = {}
        self.looked_at = 0.0  # when the reports were asked for
        self.seen: dict = {}  # (rank, group, seq) -> when first seen waiting in it
        self.waited: dict = {}  # rank -> seconds in its current collective, at the last look
        self.apart_since = None  # when some ranks were first seen finished, others running
        self.apart = False
        self.off = False  # no doctor on this pool (no process group): stay quiet
        self.printed = ""

    def _ask(self, now: float) -> None:
        from nbpar.pool import doctor

        if not self.doctor_ready(now):  # the kernel still imports torch.distributed
            return
        try:
            self.question = doctor.Question(self.pool, ranks=list(self.ars))
        except Exception:
            self.off = True
            return
        self.asked_at, self.next_look = now, now + LOOK_S

    def _collect(self, now: float) -> None:
        from nbpar.pool import doctor

        try:
            report = self.question.report(timeout=0)
        except Exception:
            self.question, self.off = None, True
            return
        if self.question.keys and now < self.asked_at + doctor.ANSWER_S:
            return  # more answers to come
        self.question = None
        self.reports, self.looked_at = report.reports, self.asked_at
        self.diagnosis, self.view = report.diagnosis, report.lines(FRAMES)[2:]
        self.waited, stuck = {}, False
        for r, rep in self.reports.items():
            c = rep.get("waiting_in")
            if rep.get("state") == "in collective" and c:
                first = self.seen.setdefault((r, c["group_id"], c["seq"]), self.asked_at)
                self.waited[r] = self.asked_at - first
                stuck = stuck or self.waited[r] >= LOOK_S
            elif rep.get("state") == "in collective":
                self.waited[r] = 0.0
        long_apart = self.apart_since is not None and self.asked_at - self.apart_since >= LOOK_S
        if stuck or long_apart or doctor._mismatch(self.reports):
            if not self.apart and stuck:
                self.pool.prepare_restart()  # the likely next step: warm engines for it
            self.apart = True

    def poll(self) -> str:
        """What the live area should say now: '' until the ranks are apart, and once the
        cell ends. Never raises and never waits."""
        if self.off:
            return ""
        now = self.clock()
        finished = [r for r, ar in self.ars.items() if ar.ready()]
        if len(finished) == len(self.ars):
            return ""
        if finished and self.apart_since is None:
            self.apart_since = now
        if self.question is not None:
            self._collect(now)
        elif now >= self.next_look:
            self._ask(now)
        if not self.apart:
            return ""
        head = f"nbpar, {now - self.start:.0f} s into the cell: " + describe(
            self.reports, finished, self.waited, list(self.ars)
        )
        return "\n".join([head, STOP_HINT, f"diagnosis: {self.diagnosis}", *self.view])

    def show(self, live) -> None:
        """Into ``live``'s area when it has one, else the first two lines to stderr
        whenever they say something new (the seconds aside)."""
        text = self.poll()
        if live.show:
            live.set_footer(text)
            return
        lines = "\n".join(text.splitlines()[:2])
        key = re.sub(r"\d+ s\b", "", lines)
        if lines and key != self.printed:
            self.printed = key
            print(lines, file=sys.stderr, flush=True)
