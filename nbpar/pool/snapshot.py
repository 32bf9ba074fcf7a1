"""Engine side of the hang doctor: where this rank is, asked from a side thread.

A daemon thread on every engine waits on the rendezvous TCPStore (its own
connection) for a request of the kernel's ``pool.doctor()`` and answers with a
snapshot: the main thread's Python stack (read with ``sys._current_frames``, so it
works while the main thread is blocked inside a collective, which releases the
GIL) and the rank's recent collectives from torch's flight recorder (gloo and
nccl both keep one; nbpar turns it on for every process group it makes).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

#: Collectives the flight recorder keeps per process group (oldest dropped).
RECORDER_ENTRIES = 64
#: Collectives a snapshot reports.
RECENT = 12
#: Key prefix of the doctor's requests and answers in the rendezvous store.
KEY = "nbpar/doctor"
POLL_S = 0.2  # how often an engine looks for a doctor request
# Process-wide registry (one per engine): the generation of the serving thread; a
# re-join starts a new thread and the old one stops at its next wake-up.
_serving = {"generation": 0}


def enable_recorder() -> None:
    """Turn torch's flight recorder on for process groups made after this call."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(RECORDER_ENTRIES))


def collectives(backend: str, last: int = RECENT) -> list[dict]:
    """This rank's latest collectives: seq, op, group, shapes, state (oldest first)."""
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace_json", None) if backend == "nccl" else None
        dump = dump or c10d._dump_fr_trace_json
        entries = json.loads(dump(True, False)).get("entries", [])
    except Exception:  # a backend without a flight recorder
        return []
    out = []
    for e in entries[-last:]:
        pg = e.get("process_group") or ["", ""]
        p2p = bool(e.get("is_p2p"))
        done = e.get("retired") or e.get("state") == "completed"
        out.append(
            {
                "seq": e.get("p2p_seq_id" if p2p else "collective_seq_id"),
                "op": str(e.get("profiling_name", "?")).split(":")[-1],
                "group": pg[1] if pg[1] not in ("", "default_pg") else "default",
                "group_id": pg[0],
                "shapes": e.get("input_sizes") or [],
                "dtypes": e.get("input_dtypes") or [],
                "state": "completed" if done else e.get("state", "scheduled"),
            }
        )
    return out


def _is_start(fs) -> bool:
    """The frame that runs user code: IPython's run_code (a cell), ipyparallel's apply."""
    return (fs.name == "run_code" and fs.filename.endswith("interactiveshell.py")) or (
        fs.name in ("do_apply", "apply_request") and "ipyparallel" in fs.filename
    )


def stack(thread_id: int) -> tuple[list[dict], bool]:
    """(frames of user code, innermost last; whether user code is running at all)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return [], False
    summary = traceback.extract_stack(frame)
    starts = [i for i, fs in enumerate(summary) if _is_start(fs)]
    if not starts:
        return [], False  # the engine waits for work
    user = summary[starts[-1] + 1 :]
    if summary[starts[-1]].name == "do_apply":  # skip the `result = f(*args)` it execs
        user = user[1:]
    return [
        {
            "file": fs.filename,
            "line": fs.lineno,
            "function": fs.name,
            "code": (fs.line or "").strip(),
        }
        for fs in user
    ], True


def _in_torch_distributed(frame: dict) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in frame["file"]


def snapshot(rank: int, backend: str, thread_id: int) -> dict:
    """Where this rank is: state, the user's line, its stack and recent collectives."""
    frames, busy = stack(thread_id)
    recent = collectives(backend)
    if not busy:
        state = "idle"
    elif frames and _in_torch_distributed(frames[-1]):
        state = "in collective"
    else:
        state = "running"
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f["file"]]
    where = None
    if frames:
        cell = frames[0]["function"] == "<module>"
        at = frames[0] if cell else (user[-1] if user else frames[-1])
        where = {**at, "cell": cell}
    pending = [c for c in recent if c["state"] != "completed"]
    return {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "state": state,
        "where": where,
        "stack": frames,
        "collectives": recent,
        "waiting_in": (pending[-1] if pending else None) if state == "in collective" else None,
    }


def serve(addr: str, port: int, rank: int, backend: str) -> None:
    """Start the thread that answers the doctor's requests for this process group."""
    _serving["generation"] += 1
    args = (_serving["generation"], addr, port, rank, backend, threading.main_thread().ident)
    threading.Thread(target=_serve, args=args, name="nbpar-doctor", daemon=True).start()


def _serve(generation: int, addr: str, port: int, rank: int, backend: str, thread_id: int) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))
        done = int(store.add(f"{KEY}/seq", 0))  # answer only requests made from now on
    except Exception:
        return
    while _serving["generation"] == generation:
        # poll with check(), not a blocking wait(): each wait() that times out makes the
        # C++ store client log a warning to stderr, which would land in every long cell
        try:
            requested = store.check([f"{KEY}/req/{done + 1}"])
        except Exception:
            return  # the store is gone: the process group was left or rank 0 died
        if not requested:
            time.sleep(POLL_S)
            continue
        done += 1
        try:
            answer = snapshot(rank, backend, thread_id)
            if store.get(f"{KEY}/req/{done}") == b"abort":
                answer["aborted"] = _abort(backend)
        except Exception as err:  # never let the doctor take the engine down
            answer = {"rank": rank, "pid": os.getpid(), "error": repr(err)}
        try:
            store.set(f"{KEY}/rep/{done}/{rank}", json.dumps(answer))
        except Exception:
            return


def _abort(backend: str) -> bool:
    """Abort this rank's communicators (nccl only): a blocked collective then raises."""
    if backend != "nccl":
        return False
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()
    return True
