"""Bytes that collectives and point-to-point ops move, seen at the c10d layer.

`CommMeter` is a TorchDispatchMode: every ``c10d`` op that passes the dispatcher
while it is active (DDP's bucket all-reduces, ZeroRedundancyOptimizer's broadcasts,
FSDP2's all-gathers and reduce-scatters, DeepSpeed's collectives, DTensor's
redistributions, pipelining's send/recv) is counted with its tensors' sizes and its
group's size, whatever strategy launched it. Bytes are what one rank sends under the
usual ring algorithms (Thakur et al. 2005; the accounting of the ZeRO paper):
all-reduce 2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the whole
(gathered) tensor, broadcast (n-1)/n, send its tensor, recv nothing (its sender counts it).

A dispatch mode sends every op of the step through Python, so a run meters one sampled
step (the loop's choice), not all of them.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

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
    "alltoall_": ("all_to_all", 0, lambda n: (n - 1) / n),
    "alltoall_base_": ("all_to_all", 0, lambda n: (n - 1) / n),
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
    n = _resolve_process_group(args[-1]).size()
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


def _group_size(args) -> int | None:
    """Size of the ProcessGroup among a c10d op's arguments (it arrives as a
    TorchScript object that `ProcessGroup.unbox` turns back into the group)."""
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in args:
        if type(a).__name__ == "ScriptObject" and "ProcessGroup" in a._type().name():
            return ProcessGroup.unbox(a).size()
    return None


def moved_bytes(op: str, args) -> tuple[str, float] | None:
    """(kind, bytes this rank sends) of one c10d op call, or None if it is no
    collective or point-to-point op."""
    if op not in _RING:
        return None
    kind, arg, factor = _RING[op]
    n = _group_size(args) or 1
    if arg is None or n < 1:
        return kind, 0.0
    whole = _tensor_bytes(args[arg])
    if kind == "all_gather" and op in ("allgather_", "allgather_coalesced_"):
        whole = _tensor_bytes(args[0])  # list of n output tensors: the whole result
    return kind, whole * factor(n)


class CommMeter(TorchDispatchMode):
    """Count the bytes each kind of c10d op moves while active (see module doc)."""

    def __init__(self):
        super().__init__()
        self.bytes_by_op: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func.__name__.split(".")[0]
            args_ = list(args) + list((kwargs or {}).values())
            moved = (moved_bytes if func.namespace == "c10d" else functional_moved_bytes)(
                name, args_)
            if moved is not None:
                kind, nbytes = moved
                self.bytes_by_op[kind] = self.bytes_by_op.get(kind, 0.0) + nbytes
                self.calls[kind] = self.calls.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return int(round(sum(self.bytes_by_op.values())))

    def by_op(self) -> dict[str, int]:
        return {k: int(round(v)) for k, v in sorted(self.bytes_by_op.items())}
