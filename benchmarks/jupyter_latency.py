"""What a person feels from a Jupyter client: nbpar vs raw ipyparallel vs jupyter-distributed.

    python benchmarks/jupyter_latency.py [--starts 10] [--cells 60] [--quick]

Real kernels driven by jupyter_client, as a notebook front end drives them: each cell is
an execute_request on the shell channel, timed from the send to the kernel's status
'idle' for it on iopub (every output of the cell has arrived by then). Start-up: from
``KernelManager.start_kernel`` to the idle of the first completed 2-rank all_reduce,
each side alone (the others shut down), the order rotating over repeats. nbpar: an
ipykernel, the quickstart's cells ``import nbpar`` + ``%load_ext nbpar``, ``pool =
nbpar.Pool(2)``, a ``%%dist`` all_reduce. Raw ipyparallel: an ipykernel, ``rc =
ipp.Cluster(n=2).start_and_connect_sync()``, a ``%%px`` cell that joins a gloo group
by hand, a ``%%px`` all_reduce. jupyter-distributed 0.1.1: its kernel proxy (``python
-m jupyter_distributed.kernel``, the command and environment its server extension's
coordinator gives a kernel of world size 2, without a Jupyter server), which starts two
rank ipykernels and forwards each cell to both; a cell ``init_process_group("gloo")``
(its ranks carry the torch env vars), an all_reduce cell. Cells: one ipykernel holding
both an nbpar pool and a raw ipyparallel cluster, and one jupyter-distributed kernel,
all up; per round, a trivial cell (``x = 1``: local in the nbpar kernel, ``%%dist``,
``%px``, jupyter-distributed's), a cell with one 4-byte all_reduce and a cell printing
100 lines per rank (nbpar streaming, its default in a kernel), the order of the sides
rotating each round; a first round warms up. Ratios are taken within a repeat or round.

Targets: trivial %%dist / local cell <= 1.5; nbpar / jupyter-distributed: trivial cell
< 1, start to first all_reduce < 1 (medians).
Writes results/jupyter_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from results import ROOT, Recorder

MISSING_JD = (
    "jupyter-distributed is not installed: "
    '.venv/bin/python -m pip install -e ".[bench]"  (jupyter-distributed==0.1.1)'
)
CELL_TIMEOUT_S = 120.0
ALLREDUCE = "t = torch.ones(1)\ndist.all_reduce(t)"  # one float32: 4 bytes
PRINTS = "for i in range(100):\n    print(f'line {i} of 100')"
FIRST_AR = (
    "import torch\nimport torch.distributed as dist\n" + ALLREDUCE + "\nprint('sum', t.item())"
)
#: what the first all_reduce prints: ones summed over 2 ranks
SUM = "sum 2.0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipp_cells(port: int) -> list[str]:
    """A raw ipyparallel start as one types it: cluster, a gloo group by hand, %px."""
    return [
        "import ipyparallel as ipp\n"
        "cluster = ipp.Cluster(n=2)\n"
        "rc = cluster.start_and_connect_sync()\n"
        "rc.activate()  # %px on this cluster (a pool's client may hold it)\n"
        "rc[:].scatter('RANK', [0, 1], flatten=True, block=True)",
        "%%px\nimport os\nimport torch.distributed as dist\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}')\n"
        "dist.init_process_group('gloo', rank=RANK, world_size=2)",
        "%%px\n" + FIRST_AR,
    ]


NBPAR_CELLS = ["import nbpar\n%load_ext nbpar", "pool = nbpar.Pool(2)", "%%dist\n" + FIRST_AR]
JD_CELLS = ["import torch.distributed as dist\ndist.init_process_group('gloo')", FIRST_AR]
#: untimed, before a kernel shuts down: its pool and cluster stopped from inside
TEARDOWN = (
    "if 'pool' in globals():\n    pool.shutdown()\n"
    "if 'cluster' in globals():\n    cluster.stop_cluster_sync()"
)


def text_of(msg: dict) -> str:
    """The text a front end shows for one iopub message ('' for none)."""
    content, kind = msg["content"], msg["header"]["msg_type"]
    if kind == "stream":
        return content["text"]
    if kind in ("display_data", "update_display_data", "execute_result"):
        return str(content.get("data", {}).get("text/plain", ""))
    if kind == "error":
        return f"{content['ename']}: {content['evalue']}\n"
    return ""


def until_idle(get_msg, msg_id: str, timeout: float) -> dict:
    """Read iopub (``get_msg(timeout=...)``, raising `queue.Empty`) until the status
    'idle' of request ``msg_id``: its outputs' text, message count and errors. Messages
    of other requests are skipped; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    got = {"text": "", "messages": 0, "errors": []}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no 'idle' for {msg_id} within {timeout:g} s")
        try:
            msg = get_msg(timeout=left)
        except queue.Empty:
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            return got
        got["messages"] += 1
        got["text"] += text_of(msg)
        if kind == "error":
            got["errors"].append(text_of(msg).strip())


class Kernel:
    """One kernel and its blocking client; ``close()`` leaves no process of it behind."""

    def __init__(self, argv: list[str] | None = None, env: dict | None = None):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        if argv:  # as jupyter-distributed's coordinator re-points a kernel's launch
            self.km.kernel_spec.argv = argv
            self.km.kernel_spec.interrupt_mode = "message"
        self.env, self.kc = env, None

    def start(self) -> None:
        self.km.start_kernel(env={**os.environ, **(self.env or {})}, cwd=str(ROOT))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=CELL_TIMEOUT_S)

    def cell(self, code: str, expect: str = "") -> tuple[float, dict]:
        """Seconds from the execute_request to its 'idle', and what it showed."""
        t = time.perf_counter()
        msg_id = self.kc.execute(code)
        got = until_idle(self.kc.get_iopub_msg, msg_id, CELL_TIMEOUT_S)
        wall = time.perf_counter() - t
        while self.kc.get_shell_msg(timeout=CELL_TIMEOUT_S)["parent_header"]["msg_id"] != msg_id:
            pass
        if got["errors"] or expect not in got["text"]:
            raise RuntimeError(f"cell {code.splitlines()[0]!r}: {got['errors'] or got['text']}")
        return wall, got

    def close(self) -> None:
        import psutil

        if self.km.has_kernel:
            procs = []
            try:
                procs = psutil.Process(self.km.provisioner.pid).children(recursive=True)
                if self.kc is not None:
                    self.kc.execute(TEARDOWN)  # best effort; the kill below is the floor
                    self.kc.get_shell_msg(timeout=60)
            except (psutil.Error, queue.Empty, RuntimeError):
                pass
            self.km.shutdown_kernel(now=False)
            _, alive = psutil.wait_procs(procs, timeout=5)
            for p in alive:
                p.kill()
        if self.kc is not None:
            self.kc.stop_channels()


class JDKernel(Kernel):
    """jupyter-distributed's proxy with 2 ranks, launched as its server extension does
    (`KernelLaunchAdapter.configure_proxy`), its rank registry reaped after."""

    def __init__(self):
        self.registry = Path(tempfile.mkdtemp(prefix="jd-registry-"))
        argv = [sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"]
        env = {
            "JUPYTER_DISTRIBUTED_BASE_KERNEL": "python3",
            "JUPYTER_DISTRIBUTED_WORLD_SIZE": "2",
            "JUPYTER_DISTRIBUTED_REGISTRY_FILE": str(self.registry / "bench.json"),
        }
        super().__init__(argv, env)

    def close(self) -> None:
        from jupyter_distributed.process_registry import OrphanProcessReaper

        try:
            super().close()
        finally:
            asyncio.run(OrphanProcessReaper(self.registry).reap())
            shutil.rmtree(self.registry, ignore_errors=True)


def time_start(side: str) -> float:
    """Seconds from starting the kernel to the idle of its first 2-rank all_reduce."""
    cells = {"nbpar": NBPAR_CELLS, "ipp": ipp_cells(free_port()), "jd": JD_CELLS}[side]
    kernel = JDKernel() if side == "jd" else Kernel()
    try:
        t = time.perf_counter()
        kernel.start()
        for code in cells[:-1]:
            kernel.cell(code)
        kernel.cell(cells[-1], expect=SUM)
        return time.perf_counter() - t
    finally:
        kernel.close()


def rotated(sides: tuple, i: int) -> tuple:
    """``sides`` starting at its ``i``-th (mod len): who goes first moves every round."""
    k = i % len(sides)
    return sides[k:] + sides[:k]


#: per kind of cell, each side's (kernel, code); "nb" is the kernel with nbpar and raw ipp
CELLS = {
    "trivial": {
        "local": ("nb", "x = 1"),
        "dist": ("nb", "%%dist\nx = 1"),
        "px": ("nb", "%px x = 1"),
        "jd": ("jd", "x = 1"),
    },
    "allreduce": {
        "dist": ("nb", "%%dist\n" + ALLREDUCE),
        "px": ("nb", "%%px\n" + ALLREDUCE),
        "jd": ("jd", ALLREDUCE),
    },
    "print": {
        "dist": ("nb", "%%dist\n" + PRINTS),
        "px": ("nb", "%%px\n" + PRINTS),
        "jd": ("jd", PRINTS),
    },
}


def time_cells(rec: Recorder, rounds: int) -> None:
    """Rows of cell round trips (ms), both kernels up, sides rotating per round."""
    kernels = {"nb": Kernel(), "jd": JDKernel()}
    try:
        for k in kernels.values():
            k.start()
        for code in NBPAR_CELLS + ipp_cells(free_port()):
            kernels["nb"].cell(code, expect=SUM if "print" in code else "")
        for code in JD_CELLS:
            kernels["jd"].cell(code, expect=SUM if "print" in code else "")
        for i in range(rounds + 1):  # round 0 warms up
            row = {"round": i, "first": rotated(tuple(CELLS["trivial"]), i)[0]}
            for kind, sides in CELLS.items():
                row[kind] = {}
                for side in rotated(tuple(sides), i):
                    where, code = sides[side]
                    wall, got = kernels[where].cell(code)
                    row[kind][side] = round(wall * 1000, 3)
                    if kind == "print":
                        row[f"print_{side}_messages"] = got["messages"]
            if i:
                rec.row(**row)
    finally:
        for k in kernels.values():
            k.close()


NAMES = {
    "local": "local cell",
    "dist": "nbpar %%dist",
    "px": "raw %px",
    "jd": "jupyter-distributed",
}
KINDS = {
    "trivial": "trivial cell",
    "allreduce": "cell with one 4-byte all_reduce",
    "print": "cell printing 100 lines per rank",
}


def figures(rec: Recorder) -> None:
    """Ratios first (measured side by side), then each side's own figure."""
    starts = [r for r in rec.rows if "start" in r]
    cells = [r for r in rec.rows if "round" in r]
    label = "kernel start to first 2-rank all_reduce"
    ratio = [r["nbpar_s"] / r["jd_s"] for r in starts]
    rec.figure(f"{label}, nbpar / jupyter-distributed", ratio, "x", "< 1", 3)
    ratio = [r["nbpar_s"] / r["ipp_s"] for r in starts]
    rec.figure(f"{label}, nbpar / raw ipyparallel", ratio, "x", digits=3)
    for side, name in (("nbpar", "nbpar"), ("ipp", "raw ipyparallel"), ("jd", NAMES["jd"])):
        rec.figure(f"{label}, {name}", [r[f"{side}_s"] for r in starts], "s", digits=3)
    triv = [r["trivial"] for r in cells]
    ratio = [t["dist"] / t["local"] for t in triv]
    rec.figure("trivial %%dist cell / local cell, same kernel", ratio, "x", "<= 1.5", 3)
    ratio = [t["dist"] / t["jd"] for t in triv]
    rec.figure("trivial cell, nbpar / jupyter-distributed", ratio, "x", "< 1", 3)
    for kind, what in KINDS.items():
        got = [r[kind] for r in cells]
        if kind != "trivial":
            ratio = [g["dist"] / g["jd"] for g in got]
            rec.figure(f"{what}, nbpar / jupyter-distributed", ratio, "x", digits=3)
        rec.figure(f"{what}, nbpar / raw %px", [g["dist"] / g["px"] for g in got], "x", digits=3)
        for side in CELLS[kind]:
            rec.figure(f"{what}, {NAMES[side]}", [g[side] for g in got], "ms", digits=3)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=10, help="start-ups per side")
    p.add_argument("--cells", type=int, default=60, help="rounds of cells (values per figure)")
    p.add_argument("--quick", action="store_true", help="a short check: 1 start-up each, 6 rounds")
    args = p.parse_args()
    if args.quick:
        args.starts, args.cells = 1, 6
    try:
        import jupyter_distributed
    except ImportError:
        raise SystemExit(MISSING_JD) from None
    rec = Recorder(
        "jupyter_latency",
        "cell latency from a Jupyter client: nbpar vs raw ipyparallel vs jupyter-distributed",
        __doc__.split("\n\n", 2)[2].split("\n\nTargets")[0],
        repeats=args.cells,
        measures=["nbpar/pool", "nbpar/__init__.py", "benchmarks/jupyter_latency.py"],
        config={
            "ranks": 2,
            "starts": args.starts,
            "cell_rounds": args.cells,
            "quick": args.quick,
            "jupyter_distributed": jupyter_distributed.__version__,
        },
    )
    for i in range(args.starts):
        order = rotated(("nbpar", "ipp", "jd"), i)
        rec.row(start=i, first=order[0], **{f"{s}_s": round(time_start(s), 4) for s in order})
    time_cells(rec, args.cells)
    figures(rec)
    rec.save()


if __name__ == "__main__":
    main()
