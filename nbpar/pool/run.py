"""A training run on a pool: started at once, watched while it trains.

The engines train in their main thread and publish one record per step
through ipyparallel's data publication (no round trip that would pause
training); the client reads them from the AsyncResults as they arrive.
Stopping goes through the rendezvous TCPStore: the client sets a key, the
ranks read it at each step boundary and agree (an all-reduce), so every rank
stops at the same step.
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid

from nbpar.measure.records import result_rank
from nbpar.pool.execute import OUTPUT_WAIT_S, wait_all

#: Key prefix of a rank's set-up stage in its published data (not a step record).
PHASE = "phase"


def train_on_engine(cfg: dict, run_id: str, models: dict | None = None) -> dict:
    """Engine side: run_training with publication and a stop flag; ``models`` are the
    kernel's `nbpar.register_model` entries the config names."""
    from ipyparallel.datapub import publish_data

    from nbpar.model.registry import adopt
    from nbpar.pool import worker
    from nbpar.train.loop import run_training

    adopt(models or {})
    seq = itertools.count()
    store = worker._state.get("store")
    key = f"stop/{run_id}"

    def publish(record: dict) -> None:
        publish_data({f"{run_id}/{next(seq):08d}": record})

    def phase(text: str) -> None:  # one key, overwritten: `Run.phase` reads the latest
        publish_data({f"{PHASE}/{run_id}": {"text": text, "time": time.time()}})

    def should_stop() -> bool:  # run_training makes all ranks agree on it
        return bool(store is not None and store.check([key]))

    return run_training(cfg, publish=publish, should_stop=should_stop, phase=phase)


class RunResult(dict):
    """What `Run.result()` returns: the CLI's JSON dict, unchanged (same keys, plain
    values, ``json.dumps`` as before); a notebook displays it as a summary, not as
    every loss value."""

    def summary(self) -> list[str]:
        from nbpar.view.compare import describe

        return describe(self)

    def _repr_pretty_(self, p, cycle):
        p.text("{...}" if cycle else "<nbpar run result>\n" + "\n".join(self.summary()))

    def _repr_html_(self):
        import html

        lines = self.summary()
        return (
            f"<div class='nbpar-result'><b>{html.escape(lines[0])}</b><br>"
            + "<br>".join(html.escape(x) for x in lines[1:])
            + "</div>"
        )


class Run:
    """One ``pool.train(cfg)``: live history, ``wait()``, ``stop()``, ``result()``."""

    def __init__(self, pool, cfg, ranks):
        from nbpar.model.registry import entry, portable_fields

        self.pool, self.cfg, self.ranks = pool, cfg, ranks
        self.run_id = uuid.uuid4().hex[:12]
        self.started = time.time()
        self._results = None
        self._model_counts = None  # (parameter sizes, tp-replicated count), for estimate()
        self.stop_asked = False
        self._ars = {
            r: pool.client[pool.engine_id(r)].apply_async(
                train_on_engine, portable_fields(cfg.to_dict()), self.run_id, entry(cfg.model)
            )
            for r in ranks
        }
        pool.track(self._ars, run=self)

    # -- live state ----------------------------------------------------------
    def done(self) -> bool:
        return all(ar.ready() for ar in self._ars.values())

    @property
    def history(self) -> list[dict]:
        """Every published step record so far, ordered by (step, rank)."""
        records = []
        for ar in self._ars.values():
            data = ar.data if isinstance(ar.data, dict) else {}
            records.extend(v for k, v in sorted(data.items()) if k.startswith(self.run_id))
        return sorted(records, key=lambda rec: (rec["step"], rec["rank"]))

    @property
    def phase(self) -> str | None:
        """Before the first step ends: the set-up stage of the rank furthest behind
        (``"importing DeepSpeed and building its engine"``), with its seconds so far;
        None once a step was published."""
        if self.history:
            return None
        said = []
        for ar in self._ars.values():
            data = ar.data if isinstance(ar.data, dict) else {}
            said.append(data.get(f"{PHASE}/{self.run_id}"))
        if not all(said):  # a rank that has not said is still in train_on_engine's imports
            return f"the ranks are importing the training code, {time.time() - self.started:.0f} s"
        last = min(said, key=lambda p: p["time"])  # the stage the slowest rank is in
        return f"{last['text']}, {time.time() - last['time']:.0f} s"

    # -- control -------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Run:
        """Block until every rank finished; Ctrl-C / the interrupt button stops the run
        at a step boundary and re-raises KeyboardInterrupt."""
        try:
            wait_all(self.pool, self._ars, timeout, interruptible=False)
        except KeyboardInterrupt:
            self.stop()
            try:
                wait_all(self.pool, self._ars, 10.0)
            except Exception:
                from nbpar.pool.execute import interrupt

                interrupt(self.pool, [r for r, a in self._ars.items() if not a.ready()], self._ars)
            raise
        for ar in self._ars.values():  # the last records may trail the reply
            ar.wait_for_output(OUTPUT_WAIT_S)
        return self

    def stop(self) -> None:
        """Ask every rank to stop after its current step."""
        store = self.pool.store()
        store.set(f"stop/{self.run_id}", "1")
        self.stop_asked = True

    def result(self) -> dict:
        """The CLI's JSON shape: config, losses, per-rank memory, timing."""
        self.wait()
        if self._results is None:
            self._results = {r: ar.get() for r, ar in self._ars.items()}
        res = self._results

        def measured(key: str) -> list:
            """The ranks' figures of ``key`` where they were measured (not None)."""
            return [res[r][key] for r in self.ranks if res[r].get(key) is not None]

        comm = measured("comm_fraction")
        exposed = measured("exposed_comm_fraction")
        waits = measured("comm_wait_fraction")
        blocked = measured("comm_blocked_fraction")
        bubbles, forced = measured("bubble_fraction"), measured("schedule_bubble_fraction")
        stalled = measured("bubble_fraction_with_stalls")
        reliable, note = self.timing_verdict()
        return RunResult(
            {
                "config": self.cfg.to_dict(),
                "losses": res[self.ranks[-1]]["losses"],
                "ranks": [result_rank(res[r]) for r in self.ranks],
                "step_time_s": max(res[r]["step_time_s"] for r in self.ranks),
                "comm_fraction": statistics.mean(comm) if comm else 0.0,
                "exposed_comm_fraction": statistics.mean(exposed) if exposed else None,
                "comm_wait_fraction": statistics.mean(waits) if waits else None,
                "bubble_fraction": max(bubbles) if bubbles else None,
                "schedule_bubble_fraction": max(forced) if forced else None,
                # whether the time figures above can be trusted on this machine, and why
                "timing_reliable": reliable,
                "timing_note": note,
                # every normal step's blocked share (`nbpar.measure.blocked`), ranks' mean
                "comm_blocked_fraction": statistics.mean(blocked) if blocked else None,
                # pipeline: the typical step's bubble with its stalls counted as they ran
                "bubble_fraction_with_stalls": max(stalled) if stalled else None,
            }
        )

    def timing_verdict(self) -> tuple[bool, str]:
        """(reliable, one line why) for this run's time figures (`nbpar.measure.machine`):
        the hosts' state over the steps, and the spread of each rank's normal steps
        (after the two with one-off set-up, the metered ones left out)."""
        from nbpar.measure.machine import step_spread, timing_verdict
        from nbpar.measure.step_split import normal_step_times

        res = self.per_rank()
        spreads = [step_spread(normal_step_times(res[r]["history"])) for r in self.ranks]
        spreads = [s for s in spreads if s is not None]
        return timing_verdict(
            [res[r]["machine"] for r in self.ranks], max(spreads) if spreads else None
        )

    def estimate(self, rank: int = 0):
        """The analytic memory estimate for this run's model, strategy and degrees, as
        rank ``rank`` holds it (ranks differ where DeepSpeed's partitions split a
        parameter, `nbpar.ds_partition`)."""
        from nbpar.estimate import estimate_config
        from nbpar.model.models import build_model
        from nbpar.model.plan import expert_parameter_count, tp_replicated_parameters

        world = len(self.ranks)
        dims = self.cfg.dims(world)
        if self._model_counts is None:  # built once: a run's estimate per rank is cheap
            model = build_model(self.cfg)
            experts = expert_parameter_count(model)
            # the experts stay whole on every tp rank too; the estimate counts them apart
            replicated = tp_replicated_parameters(model) - experts if dims.tp > 1 else 0
            self._model_counts = [p.numel() for p in model.parameters()], replicated, experts
        sizes, replicated, experts = self._model_counts
        return estimate_config(
            self.cfg,
            world,
            sum(sizes),
            expert_params=experts,
            tp_replicated=replicated,
            param_sizes=sizes,
            dp_rank=rank if dims.tp == dims.pp == 1 else 0,
        )

    def memory_vs_estimate(self) -> dict:
        """Per rank: measured param/grad/optimizer bytes next to that rank's estimate."""
        return {
            row["rank"]: self.estimate(row["rank"]).compare(row) for row in self.result()["ranks"]
        }

    def per_rank(self) -> dict:
        self.wait()
        return {r: ar.get() for r, ar in self._ars.items()}

    def _ipython_display_(self):
        """Show the live dashboard; it keeps updating in a background thread."""
        from nbpar.view.dashboard import Dashboard

        self.dashboard = Dashboard(self).show()

    def __repr__(self):
        from nbpar.model.registry import display_name

        steps = {rec["step"] for rec in self.history}
        state = "running"
        if self.done():
            state = "stopped" if self.stop_asked and len(steps) < self.cfg.steps else "done"
        return (
            f"<nbpar.Run {self.cfg.strategy}/{self.cfg.backend} "
            f"{display_name(self.cfg.model)}: "
            f"{len(steps)}/{self.cfg.steps} steps, {state}>"
        )


def checked_config(cfg, world: int, pg_backend: str | None = None):
    """The config as it runs on ``world`` ranks of a pool on ``pg_backend`` (None: this
    host's default), checked once before any engine works: `TrainConfig.validate`, then
    the model and its first batch built and run here (`nbpar.probe.check_model`), so a
    bad factory or batch is one line, not a hang."""
    from nbpar import device
    from nbpar.checks import about
    from nbpar.probe import check_model

    checked = cfg.validate(world, pg_backend=pg_backend)
    with about("model"):
        check_model(checked, world, pg_backend or device.default_backend())
    return checked


def launch(pool, checked) -> Run:
    """Start a run of a config `checked_config` passed for this pool."""
    from nbpar.errors import PoolError
    from nbpar.strategies import engines_for

    ranks = list(range(engines_for(checked.strategy, pool.n)))
    busy = pool.busy_ranks(ranks)
    if busy:  # queued behind it silently, it would sit at "starting..." for the whole run
        from nbpar.pool.status import busy_message

        raise PoolError(busy_message(pool, busy, "a new run"))
    return Run(pool, checked, ranks)


def start_run(pool, cfg=None, **overrides) -> Run:
    """Check ``cfg`` against the pool (before any engine works) and start it."""
    from nbpar.config import TrainConfig

    if cfg is None:
        cfg = TrainConfig(**overrides)
    elif overrides:
        cfg = TrainConfig.from_dict({**cfg.to_dict(), **overrides})
    from nbpar.strategies import engines_for

    backend = getattr(pool, "backend", None)  # None: this host's default (a stand-in pool)
    return launch(pool, checked_config(cfg, engines_for(cfg.strategy, pool.n), backend))
