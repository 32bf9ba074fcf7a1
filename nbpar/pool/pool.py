"""A pool of ipyparallel engines that form one torch.distributed process group.

``Pool(2)`` starts a controller and 2 engines through ipyparallel's Cluster
(any of its launchers: local, mpi, slurm, ssh, ...), then joins every engine
to one process group: gloo on CPU, nccl with one engine per GPU.
"""

from __future__ import annotations

import atexit
import weakref

from nbpar import device
from nbpar.errors import PoolError, UsageError
from nbpar.pool import forked, startup
from nbpar.pool.forked import ForkServer
from nbpar.pool.progress import StartProgress

# The process-wide registry of pools (the kernel's): every pool not shut down, and the
# one `%%dist` runs on. Module globals, so a re-run cell finds and replaces the pool.
_live: weakref.WeakSet[Pool] = weakref.WeakSet()
_current: weakref.ref[Pool] | None = None


def current() -> Pool:
    """The pool that ``%%dist`` runs on: the one made or activated last."""
    pool = _current() if _current else None
    if pool is None or pool.closed:
        raise PoolError(
            "no pool is running: start one with `pool = nbpar.Pool(2)` (or `%dist start 2`)"
        )
    return pool


class Pool:
    """N engines, one process group, ranks in engine order.

    Parameters: ``n`` engines (default: one per GPU, else 2); ``launcher``:
    any ipyparallel engine launcher name; ``backend``: "gloo"/"nccl"
    (default: nccl with GPUs); ``timeout``: default seconds a ``%%dist`` cell
    may run (None: no limit); ``pg_timeout``: torch.distributed collective
    timeout; ``env``: variables set on every engine (e.g. NCCL knobs); ``ip``:
    interface the controller listens on (loopback unless you say otherwise);
    ``port``: rendezvous port (default: a free one); ``replace``: shut down
    the previous current pool (what re-running a notebook cell wants);
    ``restart="auto"``: after an engine dies, bring the pool back by itself
    (the failed cell or run still raises, so you know to run it again); such a
    pool keeps n spare engines warm for it. ``slurm``: with
    ``launcher="slurm"``, the engines' job options (partition, time, account, qos,
    extra ``#SBATCH`` lines: `nbpar.pool.slurm`), checked before anything starts.
    Other keyword arguments go to ``ipyparallel.Cluster``.
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        launcher: str = "local",
        backend: str | None = None,
        timeout: float | None = None,
        pg_timeout: float = 300.0,
        start_timeout: float = 120.0,
        env: dict | None = None,
        ip: str = "127.0.0.1",
        port: int | None = None,
        replace: bool = True,
        restart: str | None = None,
        slurm: dict | None = None,
        **cluster_kwargs,
    ):
        n, backend, self.note = startup.check_start(
            n, launcher, backend, timeout, port, ip, restart, slurm, cluster_kwargs.get("config")
        )
        env = {str(k): str(v) for k, v in (env or {}).items()}
        self.auto_restart = restart == "auto"
        if replace:
            previous = _current() if _current else None
            if previous is not None and not previous.closed:
                previous.shutdown()
        self.n, self.backend, self.launcher = n, backend, launcher
        self.timeout, self.pg_timeout, self.start_timeout = timeout, pg_timeout, start_timeout
        self.env, self.ip, self.port = env, ip, port
        self.cluster = None
        self.client = None
        self.owned = True
        self.closed = False
        self.engines: list[dict] = []
        self._init_requests()
        # local engines are forked from one process, which imports torch from now on
        self._forkserver = ForkServer(env) if forked.usable(launcher) else None
        progress = StartProgress()  # what it is doing, in the notebook, for these seconds
        try:
            self.cluster, self.client, self._engine_ids, self._sets = startup.start_cluster(
                n,
                launcher,
                ip,
                start_timeout,
                env,
                progress.say,
                backend,
                slurm,
                forkserver=self._forkserver,
                **cluster_kwargs,
            )
            progress.say(f"{n}/{n} engines registered; joining the process group ({backend})")
            self._rendezvous()
        except BaseException:
            self.shutdown()
            raise
        finally:
            progress.done()
        if self.auto_restart:  # it restarts by itself: keep warm engines ready for it
            self.prepare_restart()
        self.activate()
        if self.note:
            print(self.note)  # once, at start: why the GPUs are not used

    # -- lifecycle ---------------------------------------------------------
    @classmethod
    def connect(
        cls,
        url_file: str | None = None,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        n: int | None = None,
        backend: str | None = None,
        **kwargs,
    ) -> Pool:
        """Attach to an ipyparallel cluster that is already running.

        The engines join a process group; ``shutdown()`` leaves the cluster
        running (it is not ours to stop).
        """
        import ipyparallel as ipp

        self = cls.__new__(cls)
        self.backend = backend or device.default_backend()
        self.launcher, self.owned, self.closed, self.cluster = "connected", False, False, None
        self._forkserver = None
        self.note = None
        self.auto_restart = kwargs.pop("restart", None) == "auto"
        self.timeout = kwargs.pop("timeout", None)
        self.pg_timeout = kwargs.pop("pg_timeout", 300.0)
        self.start_timeout = kwargs.pop("start_timeout", 120.0)
        self.env = {str(k): str(v) for k, v in kwargs.pop("env", {}).items()}
        self.ip, self.port, self.engines = "127.0.0.1", None, []
        self._init_requests()
        client_kwargs = dict(kwargs)
        if url_file:
            client_kwargs["url_file"] = url_file
        if profile:
            client_kwargs["profile"] = profile
        if cluster_id:
            client_kwargs["cluster_id"] = cluster_id
        self.client = ipp.Client(**client_kwargs)
        try:
            if n is not None:
                self.client.wait_for_engines(
                    startup.check_size(n), timeout=self.start_timeout, interactive=False
                )
            self.n = n or len(self.client.ids)
            if self.n < 1:
                raise PoolError("the cluster has no engines")
            self._engine_ids = sorted(self.client.ids)[: self.n]
            self._rendezvous()
        except BaseException:
            self.shutdown()  # closes our client; the cluster is not ours to stop
            raise
        self.activate()
        return self

    def prepare_restart(self) -> None:
        """Start spare engines in the background, so that a restart that follows takes
        well under a second instead of an engine start-up (local engines only)."""
        if self.owned and not self.closed:
            self._sets.prepare()

    def restart_ready(self) -> bool:
        """True once prepared spare engines have registered."""
        return self.owned and not self.closed and self._sets.ready(self.client)

    def _rendezvous(self):
        """Join this pool's engines into a fresh process group (`startup.rendezvous`) and
        open the direct channel ``%%dist`` cells take (`nbpar.pool.cells`; None: they go
        through ipyparallel)."""
        self._close_cells()
        self.engines = []
        watch = startup.orphan_watch(self.cluster) if self.owned else None
        self.engines, self.addr, self.rendezvous_port = startup.rendezvous(
            self.client,
            self._engine_ids,
            backend=self.backend,
            ip=self.ip,
            port=self.port,
            pg_timeout=self.pg_timeout,
            start_timeout=self.start_timeout,
            env=self.env,
            watch=watch,
        )
        self._engine_ids = [e["engine_id"] for e in self.engines]  # rank order (by host)
        if self.owned:
            self._sets.use(self.client, self._engine_ids)
        from nbpar.pool.cells import open_channel

        self.cells = open_channel(self.client, self._engine_ids, self.engines)

    def activate(self) -> Pool:
        """Make this the pool that ``%%dist`` runs on."""
        global _current
        _live.add(self)
        _current = weakref.ref(self)
        return self

    def restart(self) -> Pool:
        """Fresh engines and a fresh process group, same kernel.

        Works after a crash, a hung collective or a timeout. A pool attached
        with ``connect`` cannot restart other people's engines; it only
        re-forms the process group.
        """
        self._check_open()
        if self.owned:
            self._engine_ids = self._sets.replace(self.client, self.start_timeout)
            self._inflight.clear()  # requests of killed engines
            self._holders.clear()
        self._rendezvous()
        self.failed_ranks = set()
        if self.auto_restart:
            self.prepare_restart()
        return self.activate()

    def shutdown(self) -> None:
        """Stop the engines and controller (if this pool started them)."""
        if getattr(self, "closed", True):
            return
        self.closed = True
        _live.discard(self)
        self._close_cells()
        try:
            startup.stop(self.cluster if self.owned else None, self.client)
        finally:
            if getattr(self, "_forkserver", None) is not None:
                self._forkserver.close()

    def _close_cells(self) -> None:
        if getattr(self, "cells", None) is not None:
            self.cells.close()
        self.cells = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- running code ------------------------------------------------------
    def _check_open(self):
        if self.closed:
            raise PoolError("this pool has been shut down: start a new one with nbpar.Pool(n)")

    def ranks(self, targets=None) -> list[int]:
        """Validate ``targets`` (None/"all", an int, a list, or "0,2-3")."""
        if targets is None or targets == "all":
            return list(range(self.n))
        if isinstance(targets, str):
            out = []
            for part in targets.split(","):
                lo, _, hi = part.strip().partition("-")
                try:
                    out.extend(range(int(lo), int(hi or lo) + 1))
                except ValueError:
                    raise UsageError(
                        f"--targets must look like '0,1' or '0-3', got {targets!r}"
                    ) from None
            targets = out
        if isinstance(targets, int):
            targets = [targets]
        bad = [r for r in targets if not isinstance(r, int) or not 0 <= r < self.n]
        if bad or not targets:
            raise UsageError(
                f"rank(s) {bad or targets} do not exist: this pool has ranks 0..{self.n - 1}"
            )
        return sorted(set(targets))

    def execute(
        self,
        code: str,
        targets=None,
        timeout: float | None = None,
        stream: bool | None = None,
        live_ranks=None,
        fresh: bool = False,
    ):
        """Run ``code`` on the target ranks; return a DistResult (raises on error).

        ``stream``: show each rank's lines live (default: in a Jupyter kernel);
        ``live_ranks``: only these ranks' lines (default: all); ``fresh``: the calling
        cell has shown nothing yet (the ``%%dist`` magic: the cell is all its own).
        """
        from nbpar.pool.execute import run_cell

        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        return run_cell(self, code, self.ranks(targets), timeout, stream, live_ranks, fresh)

    def run(self, fn, *args, targets=None, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on each target rank; results in rank order."""
        from nbpar.pool.execute import wait_all

        self._check_open()
        ranks = self.ranks(targets)
        ars = {r: self.client[self._engine_ids[r]].apply_async(fn, *args, **kwargs) for r in ranks}
        wait_all(self, ars, self.timeout if timeout is None else timeout)
        return [ars[r].get() for r in ranks]

    def _init_requests(self) -> None:
        self._inflight: dict = {}  # rank -> the AsyncResult of its latest cell or run
        self._holders: dict = {}  # rank -> the training run its latest request belongs to
        self._views: dict = {}  # (engine ids, ranks) -> DirectView
        self.failed_ranks: set[int] = set()  # ranks of the last failed cell (%dist debug)
        self._store: tuple = (None, None)  # ((addr, port), the kernel's store connection)
        self.cells = None  # the direct cell channel (`nbpar.pool.cells`), once joined

    def note_failure(self, ranks) -> None:
        """Remember the ranks whose cell raised last: their tracebacks can be debugged."""
        self.failed_ranks = set(ranks)

    def track(self, ars: dict, run=None) -> None:
        """Remember ``ars`` (rank -> AsyncResult) as what each rank is running now, and
        the training ``run`` they belong to (None: a cell)."""
        self._inflight.update(ars)
        for r in ars:
            self._holders[r] = run

    def holder(self, ranks):
        """The training run the latest requests of ``ranks`` belong to (None: cells)."""
        return next((self._holders[r] for r in ranks if self._holders.get(r) is not None), None)

    def busy_ranks(self, ranks=None) -> list[int]:
        """Ranks still running a cell or a run that this pool started."""
        ranks = range(self.n) if ranks is None else ranks
        return [r for r in ranks if r in self._inflight and not self._inflight[r].ready()]

    def view(self, ranks):
        """A DirectView on the engines of ``ranks`` (cached: views cost a round of setup)."""
        key = (tuple(self._engine_ids), tuple(ranks))
        views = self._views
        if key not in views:
            views.clear() if len(views) > 64 else None
            views[key] = self.client.direct_view([self._engine_ids[r] for r in ranks])
        return views[key]

    def store(self):
        """The kernel's client connection to the rendezvous store (made once per group):
        where `Run.stop` raises its flag and the doctor asks the ranks where they are."""
        import datetime

        import torch.distributed as dist

        key = (self.addr, self.rendezvous_port)
        if self._store[0] != key:
            self._store = (
                key,
                dist.TCPStore(
                    self.addr,
                    self.rendezvous_port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=10),
                ),
            )
        return self._store[1]

    def dead_ranks(self) -> list[int]:
        alive = set(self.client.ids)
        return [r for r, eid in enumerate(self._engine_ids) if eid not in alive]

    def engine_id(self, rank: int) -> int:
        return self._engine_ids[rank]

    # -- looking at it -----------------------------------------------------
    def doctor(self, abort: bool = False):
        """While a cell or run is in progress: every rank's stack and recent collectives,
        and which rank diverged. ``abort=True`` (nccl) aborts the communicators too."""
        from nbpar.pool.doctor import doctor

        self._check_open()
        return doctor(self, abort)

    def status(self) -> list[dict]:
        """One dict per rank: rank, host, pid, device, state, memory; no engine round trip."""
        from nbpar.pool.status import pool_status

        return pool_status(self)

    def __len__(self):
        return self.n

    def __repr__(self):
        from nbpar.pool.status import status_text

        return status_text(self)

    def _repr_html_(self):
        from nbpar.pool.status import status_html

        return status_html(self)

    def train(self, cfg=None, **kwargs):
        """Start a training run on the engines; returns a live Run at once."""
        from nbpar.pool.run import start_run

        self._check_open()
        return start_run(self, cfg, **kwargs)


@atexit.register
def _shutdown_all():
    for pool in list(_live):
        try:
            pool.shutdown()
        except Exception:
            pass
