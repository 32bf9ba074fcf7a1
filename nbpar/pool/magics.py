"""IPython magics: ``%%dist`` runs a cell on every rank, ``%dist`` manages the pool.

%%dist [--targets 0,1] [--timeout S] [--rank0] [--stream | --no-stream]
%dist status | start [N] | restart | shutdown | doctor | debug N
"""

from __future__ import annotations

import argparse
import functools
import shlex

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbpar.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


@functools.cache  # built once: parsing leaves no state on it
def _cell_parser() -> _Parser:
    p = _Parser(prog="%%dist", add_help=False)
    p.add_argument(
        "--targets", "-t", default=None, help="ranks to run on: 'all' (default), '0', '0,2', '0-3'"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before the cell gives up (default: the pool's)",
    )
    p.add_argument(
        "--rank0", action="store_true", help="show only rank 0's output (live and at the end)"
    )
    p.add_argument(
        "--stream",
        action="store_true",
        default=None,
        help="show each rank's lines while the cell runs (default in Jupyter and ipython)",
    )
    p.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="show the output only when the cell ends",
    )
    return p


@magics_class
class DistMagics(Magics):
    @cell_magic
    def dist(self, line, cell):
        """Run the cell on the ranks of the current pool, output grouped per rank."""
        from nbpar.pool import pool as pool_mod

        args = _cell_parser().parse_args(shlex.split(line))
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"%%dist: --timeout must be positive, got {args.timeout:g}")
        pool = pool_mod.current()
        shown = [0] if args.rank0 else None
        result = pool.execute(
            cell,
            targets=args.targets,
            timeout=args.timeout,
            stream=args.stream,
            live_ranks=shown,
            fresh=True,
        )
        result.render(shown)

    @line_magic("dist")
    def dist_line(self, line):
        """%dist status | start [N] | restart | shutdown | doctor | debug N"""
        from IPython.display import display

        import nbpar
        from nbpar.pool import pool as pool_mod

        words = shlex.split(line)
        cmd = words[0] if words else "status"
        if cmd == "start":
            n = int(words[1]) if len(words) > 1 else None
            pool = nbpar.Pool(n)
            self.shell.user_ns.setdefault("pool", pool)
            return pool
        if cmd not in ("status", "restart", "shutdown", "doctor", "debug"):
            raise UsageError(
                f"%dist: unknown command {cmd!r}; use status, start [N], "
                f"restart, shutdown, doctor or debug N"
            )
        pool = pool_mod.current()
        if cmd == "doctor":
            display(pool.doctor())
        elif cmd == "debug":
            from nbpar.pool.postmortem import debug_in_notebook

            debug_in_notebook(pool, words[1:])
        elif cmd == "status":
            display(pool)
        elif cmd == "restart":
            pool.restart()
            print(f"nbpar: restarted {pool.n} engine(s); process group ready")
        else:
            pool.shutdown()
            print(f"nbpar: shut down {pool.n} engine(s)")


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(DistMagics)
