"""Bytes that collectives and point-to-point ops move, seen at the c10d layer.

`CommMeter` is a TorchDispatchMode: every ``c10d`` op that passes the dispatcher
while it is active (DDP's bucket all-reduces, ZeroRedundancyOptimizer's broadcasts,
FSDP2's all-gathers and reduce-scatters, DeepSpeed's collectives, DTensor's
redistributions, pipelining's send/recv) is counted with its tensors' sizes and its
group's size, whatever strategy launched it. Bytes are what one rank sends under the
usual ring algorithms (Thakur et al. 2005; the accounting of the ZeRO paper):
all-reduce 2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the whole
(gathered) tensor, broadcast (n-1)/n, send its tensor, recv nothing (its sender counts it),
all-to-all the rows it sends to the other ranks, read from its split sizes (expert
parallelism's splits are uneven: (n-1)/n of the tensor only where they are even).

The same meter times the step's communication, whatever launched it: an op is in flight
from its launch until its Work completes (the Future's callback, on the backend's thread)
or, for a functional collective, until its ``wait_tensor`` returns. ``comm_s`` is the
length of the union of those intervals; ``exposed_comm_s`` the part of it during which no
compute op (any other op that passed the dispatcher) ran on this rank, i.e. communication
that compute did not hide. Python between ops counts as not hiding it, so exposed time is
an upper bound. The metered step itself is several times slower than the others (every
op goes through Python) while the collectives run at their own speed, so its shares
(seconds over `window_s`, the metered step) are shares of that slower step: they say
which strategy communicates more, not what share a normal step would show.

A collective cannot finish before every rank of its group has launched it, so part of
its time in flight is a wait for a slower rank, not communication. After a metered step
the ranks exchange when they launched each collective (`exchange_launches`; ranks on one
host share a clock); the meter then splits the exposed time into ``wait_s`` (every op in
flight still waited for a rank to join) and ``exposed_transfer_s`` (the rest). The 20%
rule of thumb is about the second; the first is imbalance between ranks, made larger by
metering, which slows each rank's compute by a different amount. Ops whose group spans
another host, and point-to-point ops, count as transfer throughout.

A dispatch mode sends every op of the step through Python, so a run meters sampled steps
(`nbpar.train.loop.is_metered`), not all of them.

On a GPU the host only queues kernels, and NCCL's Futures complete when an op is queued:
there the meter's marks are events on the device stream (`nbpar.measure.clocks`), read
once the step's work is done, and a collective ends when its Work says it completed.
"""

from __future__ import annotations

import bisect
import threading
import time

from torch.utils._python_dispatch import TorchDispatchMode

from nbpar.measure.clocks import HostClock

# c10d op name -> (kind reported, which argument holds the "whole" tensor(s), ring factor)
# factor(n) is the share of the whole tensor one rank sends.
_RING = {
    "allreduce_": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "allreduce_coalesced_": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "allgather_": ("all_gather", 0, lambda n: (n - 1) / n),
    "_allgather_base_": ("all_gather", 0, lambda n: (n - 1) / n),
    "allgather_coalesced_": ("all_gather", 0, lambda n: (n - 1) / n),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, lambda n: (n - 1) / n),
    "reduce_scatter_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "_reduce_scatter_base_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "broadcast_": ("broadcast", 0, lambda n: (n - 1) / n),
    "reduce_": ("reduce", 0, lambda n: (n - 1) / n),
    # all-to-all: what the split sizes send to the others (`all_to_all_sent`)
    "alltoall_": ("all_to_all", 1, lambda n: (n - 1) / n),
    "alltoall_base_": ("all_to_all", 1, lambda n: (n - 1) / n),
    "gather_": ("gather", 1, lambda n: (n - 1) / n),
    "scatter_": ("scatter", 0, lambda n: (n - 1) / n),
    "send": ("send_recv", 0, lambda n: 1.0),
    "recv_": ("send_recv", None, lambda n: 0.0),
    "recv_any_source_": ("send_recv", None, lambda n: 0.0),
}


# torch's functional collectives (DTensor, torch.compile): op -> (kind, ring factor);
# their group arrives by name, the gathered size as an int
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", lambda n: 2 * (n - 1) / n),
    "all_reduce_coalesced": ("all_reduce", lambda n: 2 * (n - 1) / n),
    "all_gather_into_tensor": ("all_gather", lambda n: (n - 1) / n),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("reduce_scatter", lambda n: (n - 1) / n),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda n: (n - 1) / n),
    "all_to_all_single": ("all_to_all", lambda n: (n - 1) / n),
    "broadcast": ("broadcast", lambda n: (n - 1) / n),
}


def functional_moved_bytes(op: str, args) -> tuple[str, float] | None:
    """`moved_bytes` for an op of torch.ops._c10d_functional (None for wait_tensor)."""
    if op not in _FUNCTIONAL:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    kind, factor = _FUNCTIONAL[op]
    group = _resolve_process_group(args[-1])
    n = group.size()
    if op == "all_to_all_single":  # (input, output splits, input splits, group)
        return kind, all_to_all_sent(args[0], args[2], n, group.rank())
    whole = _tensor_bytes(args[0])
    if kind == "all_gather":
        whole *= n  # the input is one rank's piece
    return kind, whole * factor(n)


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor or nested lists of them)."""
    if hasattr(obj, "untyped_storage"):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _group(args):
    """The ProcessGroup among a c10d op's arguments (it arrives as a TorchScript object
    that `ProcessGroup.unbox` turns back into the group), or None."""
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in args:
        if type(a).__name__ == "ScriptObject" and "ProcessGroup" in a._type().name():
            return ProcessGroup.unbox(a)
    return None


def all_to_all_sent(sent, input_splits, n: int, rank: int) -> float:
    """Bytes one rank sends to the others in an all-to-all: ``sent`` is its input (one
    tensor split along dim 0 by ``input_splits``, even where they are empty) or its list
    of n inputs (rank i's at i); its own share stays."""
    if isinstance(sent, (list, tuple)):
        return float(sum(_tensor_bytes(t) for i, t in enumerate(sent) if i != rank))
    whole = _tensor_bytes(sent)
    if not input_splits or sent.shape[0] == 0:
        return whole * (n - 1) / n
    row = whole / sent.shape[0]
    return row * sum(s for i, s in enumerate(input_splits) if i != rank)


def _group_name(namespace: str, args) -> str | None:
    """The name of a collective's process group (the same on every member rank)."""
    if namespace == "_c10d_functional":
        name = args[-1] if args else None
        return name if isinstance(name, str) else getattr(name, "group_name", None)
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in args:
        if type(a).__name__ == "ScriptObject" and "ProcessGroup" in a._type().name():
            return ProcessGroup.unbox(a).group_name
    return None


def exchange_launches(meter: CommMeter) -> None:
    """Every rank tells the others when it launched each collective of the metered step
    (one all_gather_object over the default group, outside the step); each meter then
    knows how long its ops waited for a slower rank (`CommMeter.set_peers`)."""
    import socket

    import torch.distributed as dist

    mine = (socket.gethostname(), meter.launches())
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, mine)
    meter.set_peers(mine[0], peers)


def moved_bytes(op: str, args) -> tuple[str, float] | None:
    """(kind, bytes this rank sends) of one c10d op call, or None if it is no
    collective or point-to-point op."""
    if op not in _RING:
        return None
    kind, arg, factor = _RING[op]
    group = _group(args)
    n = group.size() if group is not None else 1
    if arg is None or n < 1:
        return kind, 0.0
    if op == "alltoall_base_":  # (output, input, group, output splits, input splits, ...)
        return kind, all_to_all_sent(args[1], args[4], n, group.rank() if group else 0)
    if op == "alltoall_":  # (outputs, inputs, group, ...)
        return kind, all_to_all_sent(args[1], None, n, group.rank() if group else 0)
    whole = _tensor_bytes(args[arg])
    if kind == "all_gather" and op in ("allgather_", "allgather_coalesced_"):
        whole = _tensor_bytes(args[0])  # list of n output tensors: the whole result
    return kind, whole * factor(n)


def union_s(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def uncovered_s(intervals, cover) -> float:
    """Length of the union of ``intervals`` minus the union of ``cover``."""
    merged = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [m[0] for m in merged]
    total = 0.0
    # walk the union of intervals, subtracting the covered parts
    end = float("-inf")
    for a, b in sorted(intervals):
        a = max(a, end)
        if b <= a:
            continue
        end = b
        covered = 0.0
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(merged) and merged[i][0] < b:
            lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
            covered += max(0.0, hi - lo)
            i += 1
        total += (b - a) - covered
    return total


def _work_of(out):
    """The c10d Work among a c10d op's outputs (a boxed TorchScript object), or None."""
    from torch._C._distributed_c10d import Work

    for o in out if isinstance(out, (list, tuple)) else (out,):
        if type(o).__name__ == "ScriptObject" and "Work" in o._type().name():
            return Work.unbox(o)
    return None


class CommMeter(TorchDispatchMode):
    """Count the bytes each kind of c10d op moves while active, and time the
    communication in flight and exposed (see module doc)."""

    def __init__(self, clock=time.perf_counter, marks: HostClock | None = None):
        super().__init__()
        self.bytes_by_op: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.clock = clock
        # what times the ops: the host's clock, or the device stream's (`step_clock`)
        self.marks = marks if marks is not None else HostClock(clock)
        self._lock = threading.Lock()
        self._flight: list[list[float | None]] = []  # [start, end]; end None until done
        self._pending: dict[int, list] = {}  # functional collective output -> its interval
        self._compute: list[tuple[float, float]] = []
        self._opened_at: float | None = None
        self._closed_at: float | None = None
        self._polled: list = []  # (Work, interval) watched by asking the Work
        self._poller: threading.Thread | None = None
        self._collectives: list[tuple[str, list]] = []  # (group name, interval), in order
        self._ready: dict[int, float] = {}  # id(interval) -> when the last rank launched

    def _done(self, interval, end=None) -> None:
        """End ``interval`` at ``end`` (a mark), or now on the host's clock."""
        with self._lock:
            if interval[1] is None:
                interval[1] = self.clock() if end is None else end

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("c10d", "_c10d_functional"):
            t0 = self.marks.mark()
            out = func(*args, **kwargs)
            self._compute.append((t0, self.marks.mark()))
            return out
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name == "wait_tensor":
            out = func(*args, **kwargs)
            interval = self._pending.pop(id(args[0]), None)
            if interval is not None:
                self._done(interval, self.marks.mark())  # the stream waited for it here
            return out
        args_ = list(args) + list(kwargs.values())
        moved = (moved_bytes if func.namespace == "c10d" else functional_moved_bytes)(name, args_)
        if moved is None:
            return func(*args, **kwargs)
        kind, nbytes = moved
        self.bytes_by_op[kind] = self.bytes_by_op.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1
        interval = [self.marks.mark(), None]
        self._flight.append(interval)
        if kind != "send_recv":
            group = _group_name(func.namespace, args_)
            if group is not None:
                self._collectives.append((group, interval))
        out = func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            self._pending[id(out)] = interval
            return out
        self.watch(_work_of(out), interval)
        return out

    def watch(self, work, interval) -> None:
        """End ``interval`` when ``work`` completes: at once without a Work (the op ran
        synchronously) or once done; through its Future where that completes with the
        work, else by asking the Work (NCCL's Future completes when the op is queued;
        gloo's send/recv have no Future)."""
        if work is None or work.is_completed():
            self._done(interval, self.marks.mark())
            return
        if not self.marks.completes_at_launch:
            try:
                work.get_future().add_done_callback(lambda fut: self._done(interval))
                return
            except RuntimeError:  # no Future: poll it
                pass
        self._poll(work, interval)

    def _poll(self, work, interval) -> None:
        """Watch a Work without a Future from a side thread, every millisecond."""
        with self._lock:
            self._polled.append((work, interval))
            if self._poller is not None:
                return
            self._poller = threading.Thread(
                target=self._poll_loop, daemon=True, name="nbpar-comm-poll"
            )
        self._poller.start()

    def _poll_loop(self) -> None:
        while True:
            with self._lock:
                for work, interval in self._polled:
                    if interval[1] is None and work.is_completed():
                        interval[1] = self.clock()
                self._polled = [p for p in self._polled if p[1][1] is None]
                if self._closed_at is not None:
                    self._poller = None
                    return
            time.sleep(0.001)

    def __enter__(self):
        self.marks.start()
        self._opened_at = self.clock()
        return super().__enter__()

    def __exit__(self, *exc):
        self.marks.settle()  # the device's queued work done: every mark can be read
        with self._lock:
            self._closed_at = self.clock()
            poller = self._poller
        if poller is not None:
            poller.join()
        self._read_marks()
        return super().__exit__(*exc)

    def _read_marks(self) -> None:
        """Every interval's marks as seconds on the host's clock (in place: the
        collectives' list holds the same intervals)."""
        seconds = self.marks.seconds
        with self._lock:
            for interval in self._flight:
                interval[0] = seconds(interval[0])
                if interval[1] is not None:
                    interval[1] = seconds(interval[1])
            self._compute = [(seconds(a), seconds(b)) for a, b in self._compute]

    def _intervals(self) -> list[tuple[float, float]]:
        """In-flight intervals; an op not done when the meter closed ends there."""
        end = self._closed_at if self._closed_at is not None else self.clock()
        with self._lock:
            return [
                (a, max(a, min(b, end)) if b is not None else max(a, end)) for a, b in self._flight
            ]

    def window_s(self) -> float:
        """Seconds the meter was open: the metered step, which holds every interval."""
        end = self._closed_at if self._closed_at is not None else self.clock()
        return end - (self._opened_at if self._opened_at is not None else end)

    def comm_s(self) -> float:
        """Seconds with at least one op of this rank in flight."""
        return union_s(self._intervals())

    def compute_s(self) -> float:
        """Seconds with a compute op (any other op that passed the dispatcher) running."""
        return union_s(self._compute)

    def exposed_comm_s(self) -> float:
        """Seconds with an op in flight and no compute op running on this rank."""
        return uncovered_s(self._intervals(), self._compute)

    def launches(self) -> dict[str, list[float]]:
        """Group name -> when this rank launched each of its collectives, in order."""
        out: dict[str, list[float]] = {}
        for group, interval in self._collectives:
            out.setdefault(group, []).append(interval[0])
        return out

    def set_peers(self, host: str, peers: list[tuple[str, dict[str, list[float]]]]) -> None:
        """Learn when the last rank of each collective's group launched it, from every
        rank's (host, `launches()`) (this rank's ``host`` included). The k-th collective
        of a group is the same op on all its members (collectives run in one order per
        group); a group with a member on another host is left out (no shared clock)."""
        counts: dict[str, int] = {}
        self._ready = {}
        for group, interval in self._collectives:
            k = counts[group] = counts.get(group, -1) + 1
            members = [(h, launched[group]) for h, launched in peers if group in launched]
            if any(h != host or len(times) <= k for h, times in members):
                continue
            self._ready[id(interval)] = max(times[k] for _, times in members)

    def _transfers(self) -> list[tuple[float, float]]:
        """In-flight intervals from the moment every rank had launched the op."""
        return [
            (max(a, min(b, self._ready.get(id(iv), a))), b)
            for iv, (a, b) in zip(self._flight, self._intervals())
        ]

    def exposed_transfer_s(self) -> float:
        """Exposed seconds in which some op in flight had every rank of its group."""
        return uncovered_s(self._transfers(), self._compute)

    def wait_s(self) -> float:
        """Exposed seconds in which every op in flight still waited for a rank to join:
        the ops' intervals before their last rank launched them, less what compute or
        another op's transfer covered (measured on its own, so wait + transfer = exposed
        is a check, not a definition)."""
        waits = [
            (a, max(a, min(b, self._ready.get(id(iv), a))))
            for iv, (a, b) in zip(self._flight, self._intervals())
        ]
        return uncovered_s(waits, [*self._compute, *self._transfers()])

    def total(self) -> int:
        return int(round(sum(self.bytes_by_op.values())))

    def by_op(self) -> dict[str, int]:
        return {k: int(round(v)) for k, v in sorted(self.bytes_by_op.items())}
