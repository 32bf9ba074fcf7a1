"""Running code on ranks and waiting for it without ever hanging the notebook.

A wait returns as soon as every rank is done, as soon as an engine dies, a
short grace period after a rank raised (its peers are then usually stuck in a
collective waiting for it), or at the timeout.
"""

from __future__ import annotations

import signal
import sys
import time

from nbpar.errors import DistTimeout, EngineDied, Interrupted, PoolError, RankError
from nbpar.pool.hangwatch import HangWatch
from nbpar.pool.stream import LiveOutput
from nbpar.pool.stream import metadata_of as _metadata

#: Seconds to let the other ranks finish after one rank failed.
GRACE_S = 2.0
#: Seconds to wait for a finished cell's output messages to arrive.
OUTPUT_WAIT_S = 5.0
#: A cell's live plot of nbpar.log records is first polled after this many seconds.
POLL_AFTER_S = 0.3
#: A wait this far along imports torch.distributed in the kernel in the background: the
#: doctor that explains a timeout or an interrupt needs it (1.5 s or more otherwise).
WARM_DOCTOR_S = 0.3
#: Seconds the ranks get to stop after an interrupt before they count as stuck.
STOP_S = 0.4
#: Seconds an interrupt may take in all, the stuck ranks' diagnosis included.
INTERRUPT_S = 0.9
# The kernel's one background import of torch.distributed (`_warm_doctor`), once started.
_warming: dict = {}


def _warm_doctor() -> None:
    import threading

    def warm():
        import torch.distributed  # noqa: F401

    if "torch.distributed" not in sys.modules and "thread" not in _warming:
        _warming["thread"] = threading.Thread(target=warm, name="nbpar-warm-doctor", daemon=True)
        _warming["thread"].start()


def _doctor_ready(deadline: float) -> bool:
    """Whether the kernel can ask the doctor now: torch.distributed imported, or its
    background import done by ``deadline``."""
    thread = _warming.get("thread")
    if thread is not None:
        thread.join(max(0.0, deadline - time.monotonic()))
        return not thread.is_alive()
    return "torch.distributed" in sys.modules


class DistResult:
    """What each rank printed, displayed and returned, in rank order."""

    def __init__(self, ranks, metadata, printed=None):
        """``printed``: (rank, stream) -> characters the terminal already showed live
        (`LiveOutput.printed`); `render` leaves them out."""
        self.ranks = list(ranks)
        self.printed = printed or {}
        self.stdout = {r: md.get("stdout", "") for r, md in zip(ranks, metadata)}
        self.stderr = {r: md.get("stderr", "") for r, md in zip(ranks, metadata)}
        self.outputs = {r: md.get("outputs", []) for r, md in zip(ranks, metadata)}
        self.results = {
            r: (md.get("execute_result") or {}).get("data", {}) for r, md in zip(ranks, metadata)
        }

    def text(self, ranks=None) -> str:
        lines = []
        for r in ranks if ranks is not None else self.ranks:
            lines += [f"[rank {r}] {line}" for line in self.stdout[r].splitlines()]
            if "text/plain" in self.results[r]:
                lines.append(f"[rank {r}] Out: {self.results[r]['text/plain']}")
        return "\n".join(lines)

    def render(self, ranks=None) -> None:
        """Print grouped output (``[rank N]`` prefixes, rank order) and displays."""
        from IPython.display import publish_display_data

        ranks = self.ranks if ranks is None else [r for r in self.ranks if r in ranks]
        for r in ranks:
            stdout = self.stdout[r][self.printed.get((r, "stdout"), 0) :]
            stderr = self.stderr[r][self.printed.get((r, "stderr"), 0) :]
            for line in stdout.splitlines():
                print(f"[rank {r}] {line}")
            for line in stderr.splitlines():
                print(f"[rank {r}] {line}", file=sys.stderr)
            if "text/plain" in self.results[r]:
                print(f"[rank {r}] Out: {self.results[r]['text/plain']}")
            # each rank's lines in messages of their own; but a flush is a round trip to
            # a kernel's output thread: none for a stream this rank wrote nothing to
            if stdout or "text/plain" in self.results[r] or self.outputs[r]:
                sys.stdout.flush()
            if stderr or self.outputs[r]:
                sys.stderr.flush()
            for out in self.outputs[r]:
                publish_display_data(out.get("data", {}), out.get("metadata", {}))

    def __repr__(self):
        return self.text() or f"<DistResult ranks={self.ranks} (no output)>"


def _failure(ar):
    """(ename, evalue, traceback lines) of a finished, failed AsyncResult."""
    try:
        ar.get(0)
    except Exception as err:  # RemoteError, EngineError, ...
        ename = getattr(err, "ename", type(err).__name__)
        evalue = getattr(err, "evalue", str(err))
        tb = getattr(err, "traceback", None)
        return ename, evalue, [tb] if tb else None
    return None


def wait_all(
    pool, ars: dict, timeout: float | None, *, interruptible: bool = True, on_poll=None, whole=None
) -> None:
    """Wait for ``ars`` (rank -> AsyncResult); raise one clear error if it fails."""
    start = time.monotonic()
    first_failure = None
    quiet_until = start + POLL_AFTER_S  # short cells never pay for on_poll
    warm_at = start + (WARM_DOCTOR_S if timeout is None else min(WARM_DOCTOR_S, timeout / 2))
    try:
        while True:
            pending = [r for r, ar in ars.items() if not ar.ready()]
            failed = [r for r, ar in ars.items() if ar.ready() and not ar.successful()]
            if failed and first_failure is None:
                first_failure = time.monotonic()
            if not pending or (failed and time.monotonic() - first_failure > GRACE_S):
                break
            dead = [r for r in pool.dead_ranks() if r in ars]
            if dead and not failed:
                failed = dead
                break
            if timeout is not None and time.monotonic() - start > timeout:
                raise _timed_out(pool, ars, pending, timeout)
            if on_poll is not None and time.monotonic() > quiet_until:
                on_poll()
            if warm_at is not None and time.monotonic() > warm_at:
                warm_at = None
                _warm_doctor()
            # one wake-up when everything is done (``whole``: the AsyncResult of all ranks)
            (whole if whole is not None else ars[pending[0]]).wait(0.1)
    except KeyboardInterrupt:
        running = [r for r, ar in ars.items() if not ar.ready()]
        if not interruptible:
            raise
        interrupt(pool, running, ars)
        raise Interrupted(
            f"rank(s) {running} were sent the interrupt (SIGINT)"
            if running
            else "nothing was running on the ranks"
        ) from None
    if not failed:
        return
    dead = [r for r in failed if r in pool.dead_ranks()]
    errors = {r: _failure(ars[r]) for r in failed if r not in dead}
    engine_errors = [r for r, e in errors.items() if e and e[0] == "EngineError"]
    dead = sorted(set(dead) | set(engine_errors))
    if dead:
        if getattr(pool, "auto_restart", False):
            pool.restart()
            raise EngineDied(
                f"the engine of rank(s) {dead} died; the pool was restarted "
                f"(restart='auto'): run the cell again",
                dead,
            )
        pool.prepare_restart()
        raise EngineDied(
            f"the engine of rank(s) {dead} died; its peers cannot finish their "
            f"collectives: run `%dist restart` (or pool.restart()) to get a full "
            f"process group back",
            dead,
        )
    still = [r for r, ar in ars.items() if not ar.ready()]
    err = RankError({r: e for r, e in errors.items() if e})
    if still:
        pool.prepare_restart()
        err.add_note(
            f"rank(s) {still} are still running (probably waiting in a collective "
            f"for the failed rank): run `%dist restart` before the next cell"
        )
    raise err


def _diagnosis(pool, timeout: float | None = None):
    """(the doctor's report or None, its one line) — never raises: it explains an error.

    Asks the ranks first and prepares spare engines while they answer: a restart is
    the likely next step. ``timeout``: seconds for the answers (None: the doctor's).
    """
    from nbpar.pool import doctor

    try:
        question = doctor.Question(pool)
    except Exception as err:
        pool.prepare_restart()
        return None, f"the doctor could not look at the ranks ({err})"
    pool.prepare_restart()
    try:
        report = question.report(doctor.ANSWER_S if timeout is None else timeout)
    except Exception as err:
        return None, f"the doctor could not look at the ranks ({err})"
    return report, report.diagnosis


def _timed_out(pool, ars, pending, timeout) -> DistTimeout:
    done = sorted(set(ars) - set(pending))
    report, why = _diagnosis(pool)
    return DistTimeout(
        f"rank(s) {pending} did not finish within {timeout:g} s"
        + (f" (rank(s) {done} did)" if done else "")
        + f": {why}"
        + "; a rank waiting in a collective stays blocked until the process-group timeout: "
        "run `%dist restart` (or pool.restart()) to continue now (`%dist doctor` for stacks)",
        pending,
        report=report,
    )


def interrupt(pool, ranks, ars, wait_s: float = STOP_S) -> None:
    """Send SIGINT to the engines of ``ranks``; report ranks that stay stuck.

    Ranks that have not stopped after ``wait_s`` (one blocked in a collective ignores
    SIGINT) are named with the doctor's diagnosis, all within about `INTERRUPT_S`.
    """
    if not ranks:
        return
    import os
    import socket

    start = time.monotonic()
    here = socket.gethostname()
    for r in ranks:
        engine = pool.engines[r]
        try:
            if engine.get("host", here) == here:
                os.kill(engine["pid"], signal.SIGINT)
            else:  # its pid means nothing here: the engine signals itself
                pool.client.send_signal(signal.SIGINT, targets=pool.engine_id(r), block=False)
        except Exception:  # gone already, or its engine does not answer
            pass
    while time.monotonic() < start + wait_s and not all(ars[r].ready() for r in ranks):
        time.sleep(0.02)
    stuck = [r for r in ranks if not ars[r].ready()]
    if not stuck:
        return
    budget = start + max(INTERRUPT_S, wait_s + 0.5)
    if _doctor_ready(budget - 0.4):
        why = _diagnosis(pool, timeout=max(0.1, budget - time.monotonic()))[1]
    else:  # the kernel is still importing torch.distributed: no waiting for it
        pool.prepare_restart()
        why = "`%dist doctor` shows where they are"
    print(
        f"nbpar: rank(s) {stuck} did not stop ({why}): run `%dist restart` to get the pool back",
        file=sys.stderr,
    )


def run_cell(
    pool,
    code: str,
    ranks,
    timeout: float | None,
    stream: bool | None = None,
    live_ranks=None,
    fresh: bool = False,
) -> DistResult:
    """Execute ``code`` on ``ranks`` (each in its engine's namespace).

    ``stream``: show each rank's lines while the cell runs (default: in a Jupyter
    kernel, where the grouped output replaces them at the end, and in the ``ipython``
    terminal, where they are printed as they come and the rest follows at the end).
    ``live_ranks``: the ranks whose lines are streamed (default: all); ``fresh``: the
    kernel's cell has shown nothing before this (`LiveOutput`).
    """
    busy = pool.busy_ranks(ranks)
    if busy:
        from nbpar.pool.status import busy_message

        raise PoolError(busy_message(pool, busy, "a cell"))
    dead = [r for r in pool.dead_ranks() if r in ranks]
    if dead:
        raise EngineDied(f"the engine of rank(s) {dead} is dead: run `%dist restart`", dead)
    if pool.cells is not None:  # straight to the engines (`nbpar.pool.cells`)
        ars, whole = pool.cells.submit(code, ranks)
    else:  # one request to all target engines (as %px does), one AsyncResult per rank
        whole = pool.view(ranks).execute(code, block=False, silent=False)
        ars = dict(zip(ranks, whole.split()))
    pool.track(ars)
    from nbpar.view.logplot import LogPlot

    plot = LogPlot(ars, show=True)  # draws nbpar.log(...) records live, if any
    live = LiveOutput(ars, stream, live_ranks, fresh=fresh)
    live.start()
    watch = HangWatch(pool, ars, _doctor_ready)  # who waits where, once the ranks come apart

    def poll():
        plot.poll()
        live.poll()
        watch.show(live)

    try:
        wait_all(pool, ars, timeout, on_poll=poll, whole=whole)
    except BaseException as err:
        live.set_footer("")  # the error (or the interrupt's word) says it now
        if not isinstance(err, RankError):
            raise
        pool.note_failure(err.ranks)
        done = [r for r in ranks if ars[r].ready() and ars[r].wait_for_output(OUTPUT_WAIT_S)]
        plot.finish()
        if len(done) == len(ranks):  # else the live area still shows the running ranks
            live.finish()
        DistResult(done, [_metadata(ars[r]) for r in done], live.printed).render()
        raise
    whole.wait_for_output(OUTPUT_WAIT_S)  # the reply can arrive before the last output
    live.finish()
    metadata = [_metadata(ars[r]) for r in ranks]
    if any(md.get("data") for md in metadata):  # something was logged with nbpar.log
        plot.finish()
    return DistResult(ranks, metadata, live.printed)
