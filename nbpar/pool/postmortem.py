"""``%dist debug N``: a post-mortem pdb on rank N's traceback, typed in the notebook.

The failed cell's traceback stays on the engine (IPython keeps it as
``sys.last_traceback``). A ``pdb.Pdb`` is set up on it there, with a string
buffer for its output; each command typed in the notebook travels to the engine
and runs through ``Pdb.onecmd``, and its output comes back. The frames and locals
are the rank's own; nothing is pickled but text. Stepping commands would trace the
engine's next work, so they are refused: a post-mortem looks, it does not resume.
"""

from __future__ import annotations

from nbpar.errors import PoolError, UsageError

#: Commands that end the session.
END = {"q", "quit", "exit", "c", "cont", "continue", "EOF"}
#: Commands that would resume or trace the engine.
REFUSED = {
    "n",
    "next",
    "s",
    "step",
    "r",
    "return",
    "unt",
    "until",
    "j",
    "jump",
    "debug",
    "interact",
    "restart",
    "run",
}
# Process-wide registry (one per engine): the open post-mortem, (pdb, output buffer).
_open: dict = {}


# -- engine side -------------------------------------------------------------
def _hidden(tb) -> bool:
    """IPython's own frames above the cell (run_code), not worth stepping through."""
    return "IPython" in tb.tb_frame.f_code.co_filename


def start_on_engine() -> str:
    """Set up pdb on this engine's last traceback; return where it stopped."""
    import io
    import pdb
    import sys

    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        raise LookupError("this engine keeps no traceback")
    while tb.tb_next is not None and _hidden(tb):
        tb = tb.tb_next
    out = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO(), stdout=out, nosigint=True)
    debugger.use_rawinput = False
    debugger.reset()
    debugger.setup(None, tb)
    debugger.print_stack_entry(debugger.stack[debugger.curindex])
    _open["pdb"] = (debugger, out)
    err = getattr(sys, "last_value", None)
    return f"{type(err).__name__}: {err}\n{out.getvalue()}"


def command_on_engine(line: str) -> str:
    debugger, out = _open["pdb"]
    out.seek(0)
    out.truncate()
    debugger.onecmd(line)
    return out.getvalue()


def close_on_engine() -> None:
    debugger, _ = _open.pop("pdb", (None, None))
    if debugger is not None:
        debugger.forget()


# -- kernel side -------------------------------------------------------------
def check_rank(pool, words) -> int:
    """The rank ``%dist debug`` names, if it has a failure to look at (else one line)."""
    if len(words) != 1:
        raise UsageError("%dist debug: name one rank, e.g. `%dist debug 1`")
    try:
        rank = int(words[0])
    except ValueError:
        raise UsageError(f"%dist debug: rank must be a number, got {words[0]!r}") from None
    pool.ranks([rank])  # "rank(s) [5] do not exist: this pool has ranks 0..1"
    if rank not in pool.failed_ranks:
        why = (
            f"the last failed cell failed on rank(s) {sorted(pool.failed_ranks)}"
            if pool.failed_ranks
            else "no cell has failed on this pool's engines"
        )
        raise PoolError(f"rank {rank} has no failure to debug: {why}")
    if rank in pool.dead_ranks():
        raise PoolError(f"rank {rank}'s engine is dead: nothing left to look at")
    return rank


class PostMortem:
    """A pdb session on one rank's last traceback: ``start()``, ``cmd(line)``, ``close()``."""

    def __init__(self, pool, rank: int):
        self.pool, self.rank = pool, rank
        self.engine = pool.client[pool.engine_id(rank)]

    def start(self) -> str:
        return self.engine.apply_sync(start_on_engine)

    def cmd(self, line: str) -> str:
        word = line.strip().split(" ", 1)[0]
        if word in REFUSED:
            return (
                f"*** `{word}` would resume rank {self.rank}; a post-mortem only looks: "
                f"use where, up, down, list, ll, args, p EXPR\n"
            )
        return self.engine.apply_sync(command_on_engine, line)

    def close(self) -> None:
        self.engine.apply_sync(close_on_engine)


def debug_in_notebook(pool, words, read=None) -> None:
    """The ``%dist debug N`` loop: read pdb commands (``input``: the notebook's prompt
    inside a kernel), print rank N's answers."""
    import builtins

    read = read or builtins.input
    session = PostMortem(pool, check_rank(pool, words))
    print(f"[rank {session.rank}] post-mortem: q to leave")
    print(session.start(), end="")
    try:
        while True:
            try:
                line = read("(Pdb) ")
            except EOFError:
                break
            if line.strip() in END:
                break
            print(session.cmd(line), end="")
    finally:
        session.close()
