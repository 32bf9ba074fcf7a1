"""What a rank holds: the bytes of tensors counted by storage, each storage once.

Strategies report their memory through these, and the memory tracker reads the
same rule, so a figure and the tracker never count a tensor two ways.
"""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank really stores (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    """Bytes held by ``tensors`` on this rank, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = local_tensor(t)
        # the storage's identity, not its address: fake tensors (nbpar.simulate) have none
        key = t.untyped_storage()._cdata
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                yield v
