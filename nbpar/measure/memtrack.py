"""What a training step really holds: the peak of live tensor storage, and activations.

`StepMemory` watches one step. It starts from the storages the step inherits (the
runner's parameters, gradients and optimizer state), counts every storage an op
creates while it runs (a TorchDispatchMode sees each op's outputs) and subtracts
each storage when it is freed (a weak reference to the storage fires), so the peak
is of memory really alive at one moment, each storage counted once, whole, never a
slice of a view. FSDP2 gathers and frees unsharded parameters by resizing storages it
keeps; the meter follows those resizes too, so a gathered weight that autograd saved
stops counting once FSDP frees it. Storages that autograd saves for backward
(``saved_tensors_hooks``) are activations; parameters saved by a layer are not.
torch's ``MemTracker`` labels more categories but refuses a module called twice in
one step, which gradient accumulation does; this meter has no such limit.

A dispatch mode sends every op through Python, so a run meters one sampled step.
If the meter cannot follow a strategy it stops counting and says why
(``memory_error``); the training step itself is never disturbed.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nbpar.measure.holdings import local_tensor, optimizer_state_tensors


def _storage(t):
    t = local_tensor(t)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    return t.untyped_storage()


class StepMemory(TorchDispatchMode):
    """Use as ``with StepMemory(runner) as mem: runner.train_step(...)``."""

    def __init__(self, runner):
        super().__init__()
        self.kind: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, state|new|saved)
        self._refs: list = []
        self.live = self.saved = self.peak = self.saved_peak = 0
        self.error: str | None = None
        try:
            for t in self._inherited(runner):
                self._add(t, "state")
        except Exception as err:
            self._fail(err)
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _inherited(runner):
        params = list(runner.parameters())
        yield from params
        yield from (p.grad for p in params if p.grad is not None)
        opt = getattr(runner, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # DeepSpeed wraps a torch optimizer
        if isinstance(opt, torch.optim.Optimizer):
            yield from optimizer_state_tensors(opt)

    def _fail(self, err: Exception) -> None:
        self.error = self.error or f"{type(err).__name__}: {err}"

    def _add(self, t, kind: str) -> None:
        st = _storage(t)
        if st is None:
            return
        key, nbytes = st._cdata, st.nbytes()
        if key in self.kind or nbytes == 0:
            return
        self.kind[key] = (nbytes, kind)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._refs.append(weakref.ref(st, lambda _, key=key: self._free(key)))

    def _free(self, key: int) -> None:
        nbytes, kind = self.kind.pop(key, (0, "state"))
        self.live -= nbytes
        if kind == "saved":
            self.saved -= nbytes

    def _pack(self, t):
        if self.error is None:
            try:
                st = _storage(t)
                entry = self.kind.get(st._cdata) if st is not None else None
                if st is not None and entry is None:
                    self._add(t, "new")
                    entry = self.kind.get(st._cdata)
                if entry is not None and entry[1] == "new":
                    self.kind[st._cdata] = (entry[0], "saved")
                    self.saved += entry[0]
                    self.saved_peak = max(self.saved_peak, self.saved)
            except Exception as err:
                self._fail(err)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.error is None:
            try:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self._add(t, "new")
            except Exception as err:
                self._fail(err)
        return out

    def _resized(self, t) -> None:
        """A storage changed size in place: FSDP2 gathers and frees its unsharded
        parameters by resizing their storages, which no dispatch mode sees."""
        if self.error is not None:
            return
        try:
            st = _storage(t)
            if st is None:
                return
            key, nbytes = st._cdata, st.nbytes()
            if key not in self.kind:
                self._add(t, "new")
                return
            old, kind = self.kind[key]
            self.kind[key] = (nbytes, kind)
            self.live += nbytes - old
            self.peak = max(self.peak, self.live)
            if kind == "saved":
                self.saved += nbytes - old
                self.saved_peak = max(self.saved_peak, self.saved)
        except Exception as err:
            self._fail(err)

    def _follow_fsdp(self, on: bool) -> None:
        """Route FSDP2's storage resizes (``alloc_storage``/``free_storage``, looked up by
        name in the modules that call them) through `_resized` while metering."""
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        except ImportError:
            return
        modules = (_fsdp_param, _fsdp_param_group)
        if not on:
            for module, saved in zip(modules, self._fsdp_saved):
                module.__dict__.update(saved)
            return
        self._fsdp_saved = [
            {n: m.__dict__[n] for n in ("alloc_storage", "free_storage") if n in m.__dict__}
            for m in modules
        ]

        def follow(fn):
            def resize(tensor):
                fn(tensor)
                self._resized(tensor)

            return resize

        for module, saved in zip(modules, self._fsdp_saved):
            for name, fn in saved.items():
                setattr(module, name, follow(fn))

    def __enter__(self):
        self._hooks.__enter__()
        self._follow_fsdp(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._follow_fsdp(False)
            self._hooks.__exit__(*exc)

    def figures(self) -> dict:
        """``tracked_peak_bytes`` and ``activation_bytes`` (peak of saved-for-backward
        storage), or ``memory_error`` when the meter could not follow the step."""
        if self.error is not None:
            return {"memory_error": self.error}
        return {"tracked_peak_bytes": self.peak, "activation_bytes": self.saved_peak}
