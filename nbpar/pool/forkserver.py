"""The fork server of a local pool: one process that imports torch and ipyparallel's
engine once, then forks every engine of the pool from that warm image.

Started as ``python -m nbpar.pool.forkserver`` by `nbpar.pool.forked.ForkServer` the
moment a local pool starts, before the kernel has imported ipyparallel. Importing
torch costs ~1.5 s of CPU; N engines that each import it cost N times that, on the
same cores the controller needs. Forked engines pay it once, and a restart or a
spare set costs a fork (milliseconds) instead of an engine start-up.

Protocol, one JSON line each way on stdin/stdout: the first line out is
``{"ready": true, "torch": <import error or null>}`` once the imports are done; then
each request ``{"argv": [...], "env": {...}, "cwd": ..., "output": <log file>}`` is
answered ``{"pid": <engine pid>}``. stdin closed: the server exits (the pool has
stopped its engines through their launchers; an engine still running exits within a
second of its parent, `nbpar.pool.orphan`). Linux only: forking a process
that loaded torch is what DataLoader workers do there; macOS and Windows start
engines one process each (`nbpar.pool.forked.usable`).

Each engine child, right after the fork and before it starts a thread or a socket:
its own session (as ipyparallel's launcher starts engines: a kernel interrupt is not
theirs), its output to its log file, the request's environment, arguments and
directory, and its nanny forked from it too (ipyparallel starts the nanny, which
relays signals and reports the engine's exit at once, as a new Python process:
~0.25 s of CPU per engine). Then ipengine runs, and the child exits with its code.
"""

import gc
import json
import os
import pickle
import signal
import sys
import traceback

#: what ``ps`` shows (``comm``) for the server, a forked engine and its nanny
SERVER_NAME, ENGINE_NAME, NANNY_NAME = "nbpar-forksrv", "nbpar-engine", "nbpar-nanny"
#: words in the command line of every process a local pool starts (engines forked by
#: the server carry its command line)
POOL_MARKERS = ("ipyparallel", "nbpar.pool.engine", "nbpar.pool.forkserver")


def is_engine(proc) -> bool:
    """Whether the psutil Process ``proc`` is an nbpar engine, started alone or forked."""
    import psutil

    try:
        return proc.name() == ENGINE_NAME or "nbpar.pool.engine" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _name(name: str) -> None:
    """What ``ps``/``top`` (and psutil's ``name()``) show for this process: a forked
    engine's command line is still the server's. Best effort (Linux prctl)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _reap(signum=None, frame=None) -> None:
    """Collect every engine that exited (a zombie would look alive to its launcher)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _redirect(output: str) -> None:
    """stdin from /dev/null, stdout and stderr appended to ``output``."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def _fork_nanny():
    """Fork this engine's nanny now, while the engine has no thread and no socket; it
    waits for the arguments ipengine gives a nanny. Returns ipengine's ``start_nanny``
    for this engine: it hands the nanny its arguments and reads back its address."""
    args_r, args_w = os.pipe()
    url_r, url_w = os.pipe()
    if os.fork() == 0:  # the nanny
        os.close(args_w)
        os.close(url_r)
        code = 0
        gc.enable()
        try:
            os.setsid()
            _name(NANNY_NAME)
            with os.fdopen(args_r, "rb") as f:
                data = f.read()
            if data:  # nothing: the engine ran without a nanny, or died first
                from ipyparallel.engine.nanny import KernelNanny

                kwargs = pickle.loads(data)
                kwargs["pipe"] = os.fdopen(url_w, "w", buffering=1)
                KernelNanny.main(**kwargs)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(args_r)
    os.close(url_w)

    def start_nanny(**kwargs):
        kwargs["pid"] = os.getpid()
        with os.fdopen(args_w, "wb") as f:
            f.write(pickle.dumps(kwargs))
        answer = os.fdopen(url_r, "rb")
        url = answer.readline().decode("utf8").strip()
        if not url:
            raise RuntimeError("nanny failed")
        return url, answer  # held open: closing it tells the nanny the engine is gone

    return start_nanny


def _engine(request: dict) -> None:
    """The forked engine: set up as the request says, run ipengine, exit."""
    code = 0
    gc.enable()
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
        os.setsid()
        _name(ENGINE_NAME)
        _redirect(request["output"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        start_nanny = _fork_nanny()
        from ipyparallel.engine import app

        from nbpar.pool.orphan import exit_with_parent

        app.start_nanny = start_nanny
        exit_with_parent()  # the server: it goes when the kernel goes
        sys.argv = [os.path.join(os.path.dirname(__file__), "engine.py"), *request["argv"]]
        app.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _warm() -> str | None:
    """Import what every engine imports; the error text where torch will not import
    (the engine reports it when a cell needs torch, as one started alone would)."""
    import ipyparallel.engine.app  # noqa: F401
    import ipyparallel.engine.nanny  # noqa: F401

    import nbpar.pool.worker  # noqa: F401

    try:
        import torch.distributed  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def serve(requests, replies) -> None:
    """Answer fork requests from ``requests`` (lines) on ``replies`` until EOF."""
    for line in requests:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _engine(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()


def main() -> None:
    gc.disable()  # imports make objects, not garbage: collecting them costs ~15% of it
    from nbpar.pool.orphan import exit_with_parent

    _name(SERVER_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel interrupt is not ours
    signal.signal(signal.SIGCHLD, _reap)
    requests, replies = sys.stdin, sys.stdout
    try:
        error = _warm()
    except Exception as e:  # ipyparallel itself: no engine can start
        replies.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        replies.flush()
        return
    gc.freeze()  # what the engines share stays shared: their collections skip it
    replies.write(json.dumps({"ready": True, "torch": error}) + "\n")
    replies.flush()
    exit_with_parent()  # after the forks' image is made: children start their own
    serve(requests, replies)


if __name__ == "__main__":
    main()
