"""The engine processes of a pool nbpar started: the ranks' engine set and a spare set.

A restart needs fresh engines, and starting one costs ~2 s of CPU (Python, ipyparallel,
``import torch``) before it registers. So when a restart looks likely (a cell timed
out, a rank failed while its peers kept waiting, an engine died), a spare set starts
in the background; the restart then kills the old engines (SIGKILL: a rank stuck in
a collective ignores gentler signals) and joins the spares, already warm, into a new
process group. Without spares, the new engines start before the old ones are
killed, so the two overlap. MPI engines ask for their rank as engine id: there the
old set must be gone before the new one starts.
"""

from __future__ import annotations

import signal
import time

from nbpar.errors import PoolError


class EngineSets:
    """The ipyparallel engine sets of one owned pool (ranks' set, spare set)."""

    def __init__(self, cluster, n: int, launcher: str):
        self.cluster, self.n = cluster, n
        self.local = launcher == "local"
        self.current = next(iter(cluster.engines), None)  # the set start_cluster made
        self.spare = None
        self._warming = None  # the spares' `warm` request, once they registered
        self.used: set[str] = set()  # uuids of engines that have been ranks

    def use(self, client, ids) -> None:
        """Mark the engines of ``ids`` as ranks (never handed out again)."""
        self.used |= {client._engines[e] for e in ids}

    def prepare(self) -> None:
        """Start a spare set in the background (local engines; once until used)."""
        if self.local and self.spare is None:
            self.spare = self.cluster.start_engines_sync(self.n)

    def ready(self, client) -> bool:
        """Whether the spare engines have registered and imported torch (a restart now
        needs no start-up). The first call that finds them registered asks them to
        finish their import, without waiting."""
        if self.spare is None or len(fresh := self._fresh(client)) < self.n:
            return False
        if self._warming is None:
            from nbpar.pool.worker import warm

            self._warming = client.direct_view(fresh[: self.n]).apply_async(warm)
        return self._warming.ready()

    def _fresh(self, client) -> list[int]:
        # by uuid, not id: MPI engines ask for their rank as id, so ids come back
        return sorted(e for e, u in client._engines.items() if u not in self.used)

    def _kill(self, set_id) -> None:
        """SIGKILL every live engine of a local set (one may be dead already)."""
        for engine in list(self.cluster.engines[set_id].launchers.values()):
            try:
                engine.signal(signal.SIGKILL)
            except Exception:  # already gone
                pass

    def replace(self, client, timeout: float) -> list[int]:
        """Kill the ranks' engines; return the ids of ``n`` fresh registered ones."""
        old = self.current
        if self.local:
            self.prepare()  # the new engines start before the old ones are killed
            self._kill(old)
            self.cluster.stop_engines_sync(old)  # reaps them, removes their logs
        else:
            self.cluster.stop_engines_sync(old)
            self.spare = self.cluster.start_engines_sync(self.n)
        self.current, self.spare, self._warming = self.spare, None, None
        deadline = time.monotonic() + timeout
        while len(fresh := self._fresh(client)) < self.n:
            if time.monotonic() > deadline:
                raise PoolError(f"engines did not come back within {timeout:g} s")
            time.sleep(0.02)
        return fresh[: self.n]
