"""`simulate(cfg, world_size=N)`: what each rank of an N-rank run would hold and send.

The config is checked as `pool.train` checks it (degrees that multiply to N, heads and
widths tp divides, layers for pp stages), then one rank per role is simulated
(`nbpar.simulate.roles`) on fake tensors (`nbpar.simulate.world`) with the strategy code
of a real run (`nbpar.simulate.runners`).
"""

from __future__ import annotations

import copy
import time

from nbpar.checks import positive_int
from nbpar.estimate import format_bytes
from nbpar.measure.records import MEMORY_PARTS
from nbpar.simulate.roles import stage_roles

PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "mixed": "bf16"}  # mixed = bf16 autocast


def prepare(cfg, world_size: int):
    """A validated copy of ``cfg`` for simulation and its ParallelDims; one-line errors."""
    from nbpar.simulate.runners import check_simulable

    positive_int("world_size", world_size)
    cfg = copy.deepcopy(cfg)
    if cfg.precision in PRECISIONS:
        cfg.precision = PRECISIONS[cfg.precision]
    # the clip norm is a number the step reads back; fake tensors have no numbers
    cfg.grad_clip = 0.0
    cfg.validate(world_size)
    check_simulable(cfg)
    return cfg, cfg.dims(world_size)


class Simulation(dict):
    """The result: ``{"config", "ranks": [...], "seconds"}`` (+ ``fits``, ``margin_bytes``)."""

    def table(self) -> str:
        """Per simulated rank, in GB: what it holds, its peak, what it sends per step."""
        from nbpar.dims import layout_words
        from nbpar.simulate.roles import describe

        cfg = self["config"]
        lines = [
            f"{cfg['strategy']} {cfg['model']} on {cfg['world_size']} ranks "
            f"({layout_words(cfg)}), {cfg['precision']}, "
            f"micro-batch {cfg['micro_batch']}: simulated in {self['seconds']:.0f} s",
            f"{'ranks':>12} {'params':>9} {'grads':>9} {'optimizer':>9} "
            f"{'activ.':>9} {'peak':>9} {'ring/step':>9}",
        ]
        for r in self["ranks"]:
            lines.append(
                f"{describe(r['stands_for']):>12} "
                + " ".join(
                    f"{format_bytes(r[k]):>9}"
                    for k in (*MEMORY_PARTS, "activation_bytes", "peak_bytes", "comm_bytes")
                )
            )
        if "fits" in self:
            lines.append(
                f"fits in {format_bytes(self['device_memory_bytes'])}: "
                f"{'yes' if self['fits'] else 'no'}, margin "
                f"{format_bytes(self['margin_bytes'])}"
            )
            if not self["fits"]:
                lines.append(why_not(self["ranks"]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


def simulate(
    cfg, world_size: int, *, device_memory_gb: float | None = None, compose: bool = True
) -> Simulation:
    """Simulate ``cfg`` on ``world_size`` ranks; per role: params, grads, optimizer state,
    activations, temporaries, communication buffers, peak, ring bytes per step by op
    (what a rank sends under the ring algorithm, counted at the c10d call).

    ``device_memory_gb`` (decimal GB, as `nbpar.estimate`) adds ``fits`` and
    ``margin_bytes`` (device memory minus the largest simulated peak).

    A pipeline's stages that hold the same module are simulated once, their steps
    composed from its segments (`nbpar.simulate.segments`); ``compose=False`` runs every
    micro-batch on every stage instead: slower, the same figures.
    """
    start = time.perf_counter()
    capacity = None if device_memory_gb is None else capacity_bytes(device_memory_gb)
    cfg, dims = prepare(cfg, world_size)
    every = stage_roles(cfg, dims, compose)
    ranks = simulate_ranks(cfg, dims, every) if dims.pp == 1 else _in_children(cfg, dims, every)
    config = {
        **cfg.to_dict(),
        "world_size": world_size,
        "dp": dims.dp,
        "tp": dims.tp,
        "pp": dims.pp,
        "cp": dims.cp,
        "ep": dims.ep,
    }
    out = Simulation(config=config, ranks=ranks, seconds=time.perf_counter() - start)
    if capacity is not None:
        out.update(fit_figures(ranks, capacity))
    return out


def simulate_ranks(cfg, dims, chosen) -> list[dict]:
    """The rows of the roles ``chosen`` (a part of `nbpar.simulate.roles.stage_roles`),
    each with the ranks it stands for."""
    from nbpar.simulate.measure import simulate_rank
    from nbpar.simulate.roles import roles

    stands_for = dict(roles(dims))
    return [
        {**row, "stands_for": stands_for[row["rank"]]}
        for rank, stages in chosen
        for row in simulate_rank(cfg, dims, rank, stages)
    ]


def _in_children(cfg, dims, every) -> list[dict]:
    """`simulate_ranks` in spawned processes, one per core at most, which share the
    roles (a role's figures do not depend on the others) and leave with ``os._exit``.

    Simulating a rank is Python per op on one core, so the pipeline stages of a large
    layout go about as many times faster as there are cores. And a process that
    simulated pipeline stages sometimes aborts while the interpreter shuts down
    ("corrupted double-linked list", or a segmentation fault when the garbage collector
    frees a simulated stage, also between two roles of one process; not root-caused):
    each child runs without the cyclic collector, hands back its results and then skips
    the shutdown, so neither a
    notebook kernel nor a test session inherits the fault.
    """
    import multiprocessing
    import os

    import cloudpickle

    n = max(1, min(len(every), os.cpu_count() or 1))
    ctx = multiprocessing.get_context("spawn")
    children = []
    for i in range(n):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=_child,
            args=(cloudpickle.dumps((cfg, dims, every[i::n])), send),
            daemon=True,
            name=f"nbpar-simulate-{i}",
        )
        child.start()
        send.close()
        children.append((child, receive))
    results, failure = [], None
    for child, receive in children:
        try:
            kind, value = cloudpickle.loads(receive.recv_bytes())
        except EOFError:
            child.join()
            kind, value = (
                "error",
                RuntimeError(
                    f"the simulation's process ended without a result (exit code {child.exitcode})"
                ),
            )
        finally:
            receive.close()
        child.join()
        if kind == "error":
            failure = failure or value
        else:
            results += value
    if failure is not None:
        raise failure
    return sorted(results, key=lambda r: r["rank"])


def _child(payload: bytes, send) -> None:
    import gc
    import os

    import cloudpickle

    gc.disable()  # see `_in_children`: a child that lives for one call needs no collector
    try:
        cfg, dims, chosen = cloudpickle.loads(payload)
        out = ("ok", simulate_ranks(cfg, dims, chosen))
    except BaseException as err:  # the parent raises it
        out = ("error", err)
    try:
        send.send_bytes(cloudpickle.dumps(out))
    finally:
        send.close()
        os._exit(0)


def capacity_bytes(device_memory_gb: float) -> int:
    """Decimal GB -> bytes; one line for anything but a positive number."""
    if (
        isinstance(device_memory_gb, bool)
        or not isinstance(device_memory_gb, (int, float))
        or not device_memory_gb > 0
    ):
        raise ValueError(f"device memory must be a positive number of GB, got {device_memory_gb!r}")
    return int(device_memory_gb * 1e9)


def why_not(ranks) -> str:
    """One line: the rank with the largest peak and what its peak was made of."""
    from nbpar.measure.records import model_state_bytes
    from nbpar.simulate.roles import describe

    r = max(ranks, key=lambda r: r["peak_bytes"])
    states, comm, temp = model_state_bytes(r), r["comm_buffer_bytes"], r["temp_bytes"]
    acts = r["peak_bytes"] - states - comm - temp
    return (
        f"ranks {describe(r['stands_for'])} peak at {format_bytes(r['peak_bytes'])}: model "
        f"states {format_bytes(states)}, activations {format_bytes(acts)}, temporaries "
        f"{format_bytes(temp)}, communication buffers {format_bytes(comm)}"
    )


def fit_figures(ranks, capacity: int) -> dict:
    """``fits`` and ``margin_bytes`` of the worst rank against ``capacity`` bytes."""
    margin = capacity - max(r["peak_bytes"] for r in ranks)
    return {"fits": margin >= 0, "margin_bytes": margin, "device_memory_bytes": capacity}
