"""Errors nbpar raises to the notebook: one clear sentence each."""

from __future__ import annotations


class Said:
    """An error whose message says all a person needs: in IPython and Jupyter it shows
    as that message, not under the traceback of nbpar's internals that raised it."""

    def _render_traceback_(self):
        lines = str(self).splitlines() or [""]
        return [f"{type(self).__name__}: {lines[0]}", *lines[1:]]


class UsageError(Said, ValueError):
    """A call, magic line or command line that cannot run as written: an unknown
    command, a bad flag, a rank that does not exist (the CLI exits 2 with it)."""


class Interrupted(Said, KeyboardInterrupt):
    """The cell or run was interrupted (the stop button, Ctrl-C); the message says what
    the ranks did about it, instead of the polling loop the interrupt landed in."""


class PoolError(Said, RuntimeError):
    """The pool cannot do what was asked (not started, shut down, busy)."""


class EngineDied(PoolError):
    """An engine process died; the message names its rank."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


class DistTimeout(PoolError, TimeoutError):
    """A cell or collective did not finish in time on some ranks; ``report`` is the hang
    doctor's look at every rank (None when it could not look)."""

    def __init__(self, message: str, ranks=(), report=None):
        super().__init__(message)
        self.ranks = list(ranks)
        self.report = report


class RankError(RuntimeError):
    """Code raised on one or more ranks; shows the first failing rank's traceback."""

    def __init__(self, errors: dict):
        self.errors = dict(sorted(errors.items()))  # rank -> (ename, evalue, traceback lines)
        ranks = list(self.errors)
        ename, evalue, _ = self.errors[ranks[0]]
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        super().__init__(f"{ename} on {where}: {evalue}")

    @property
    def ranks(self):
        return list(self.errors)

    def _render_traceback_(self):
        lines = []
        rank = self.ranks[0]
        ename, evalue, tb = self.errors[rank]
        if len(self.ranks) > 1:
            others = ", ".join(str(r) for r in self.ranks[1:])
            lines.append(f"[rank {rank}] (ranks {others} failed too; first shown)")
        for chunk in tb or [f"{ename}: {evalue}"]:
            lines.extend(f"[rank {rank}] {line}" for line in chunk.splitlines())
        return lines


class ConfigError(Said, ValueError):
    """A setting that cannot run, found before anything starts: ``fields`` names the
    settings the reason is about (TrainConfig fields such as ``"micro_batch"`` or
    ``"gpt.n_heads"``; the first is the one to change), the message says why."""

    def __init__(self, message: str, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)

    @property
    def field(self) -> str | None:
        """The setting to change first, or None when the reason names none."""
        return self.fields[0] if self.fields else None
