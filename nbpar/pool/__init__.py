"""The pool: what runs in the notebook's kernel to start, drive and watch the engines.

`pool.Pool` (engines on any ipyparallel launcher, joined into one process group;
`startup` starts its cluster and forms the group), `execute` (a cell on every rank,
output grouped per rank), `magics` (``%%dist``), `launchers`, `status`, `run` (the
handle of a training run). The engine-side half of the protocol is small and lives here
too, since it is the pool's: `engine` (the engine process's entry point), `worker`
(joining and leaving the process group on an engine), `controller` and `orphan`
(processes that exit with the kernel that started them). May import the top level and,
to ship work to engines, `nbpar.train`; never `nbpar.view` at import time. Importing
this package imports nothing else.
"""

from __future__ import annotations


def __getattr__(name):
    if name == "Pool":  # `from nbpar.pool import Pool`, as before the package existed
        from nbpar.pool.pool import Pool

        return Pool
    raise AttributeError(f"module 'nbpar.pool' has no attribute {name!r}")
