"""Bytes of activations saved for backward on one pipeline rank, and their peak.

Why a pipeline schedule matters for memory: GPipe (Huang et al. 2019) runs all
``m`` forwards before any backward, so a stage holds the saved activations of
all ``m`` micro-batches at once; 1F1B (PipeDream-Flush, Narayanan et al. 2021)
starts each micro-batch's backward early, so stage ``i`` holds at most ``p - i``.

Accounting, by micro-batch: ``torch.autograd.graph.saved_tensors_hooks`` sees
every tensor autograd saves during a stage's forward (and, on the last stage,
during the loss). Its storage bytes are added once (per storage identity)
to that (stage, micro-batch)'s live total; parameter storages are not
activations and are skipped. The total stays live until that micro-batch's
backward finishes, when autograd frees the graph (``retain_graph=False``)
and the stage drops its forward cache. The peak is the maximum over time of the
sum of live totals. Hooks have no "freed" callback, hence micro-batch liveness
rather than per-tensor liveness: it is exact for schedules with full backward
(GPipe, 1F1B, interleaved); a split backward (ZB-V, DualPipeV) keeps the graph after its
input gradient for the weight gradient, so the micro-batch stays live until its W.
Under FSDP2 (hybrid with ``fsdp_reshard``) the gathered weights a forward saves
are not the module's (sharded) parameters, so they count as activations.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

from nbpar.measure.holdings import local_tensor


class SavedActivations:
    """Live saved-for-backward bytes per (stage, micro-batch) on this rank; the peak."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget everything: call at the start of each step."""
        self._live: dict[tuple, int] = {}  # (stage, mb) -> bytes saved, not yet freed
        self._owner: dict[int, tuple] = {}  # storage id -> (stage, mb) that counted it
        self._last: tuple | None = None  # key of the latest forward (the loss joins it)
        self.peak = 0

    def _pack(self, key: tuple, skip: set):
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = local_tensor(t).untyped_storage()
            ptr, nbytes = storage._cdata, storage.nbytes()
            if nbytes and ptr not in skip and ptr not in self._owner:
                self._owner[ptr] = key
                self._live[key] = self._live.get(key, 0) + nbytes
                self.peak = max(self.peak, sum(self._live.values()))
            return t

        return pack

    @contextlib.contextmanager
    def forward(self, stage: int, mb: int, params):
        """Count what autograd saves inside this block for (stage, mb)."""
        self._last = (stage, mb)
        skip = {local_tensor(p).untyped_storage()._cdata for p in params}
        with saved_tensors_hooks(self._pack(self._last, skip), lambda t: t):
            yield

    def wrap_loss(self, loss_fn):
        """``loss_fn`` whose saved tensors count with the latest forward's micro-batch.

        Schedules compute the last stage's loss right after that stage's forward.
        """

        def loss(*args, **kwargs):
            if self._last is None:
                return loss_fn(*args, **kwargs)
            with self.forward(*self._last, params=()):
                return loss_fn(*args, **kwargs)

        return loss

    def release(self, stage: int, mb: int) -> None:
        """(stage, mb)'s backward finished: its saved tensors are freed."""
        key = (stage, mb)
        self._live.pop(key, None)
        self._owner = {p: k for p, k in self._owner.items() if k != key}

    def live_bytes(self) -> int:
        """Saved bytes not yet freed by a backward (0 after a full step)."""
        return sum(self._live.values())
