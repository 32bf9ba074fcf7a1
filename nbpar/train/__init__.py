"""The engine loop: what runs inside each engine process during a training run.

`loop` (the step loop, any strategy), `checkpoint` (save and resume), `ddp_script`
(the same run as a plain torchrun script) and `userlog` (``nbpar.log`` from your own
``%%dist`` code). May import every layer below it (model, measure, strategies, parallel,
estimate, config); never `nbpar.pool` or `nbpar.view`. Importing this package imports
nothing else.
"""

from __future__ import annotations


def __getattr__(name):
    if name == "run_training":  # `from nbpar.train import run_training`, as before
        from nbpar.train.loop import run_training

        return run_training
    raise AttributeError(f"module 'nbpar.train' has no attribute {name!r}")
