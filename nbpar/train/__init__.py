"""Engine side: what runs inside each engine process during a training run.

`loop` (the step loop, any strategy), `models`, `data`, `checkpoint` and
`checkpoint_meta`, `lr_schedule`, and the measurement a run publishes: `metrics`
(memory and communication), `timeline` (the pipeline's measured bubble),
`userlog` (``nbpar.log`` from your own ``%%dist`` code). May import the top level
and `nbpar.parallel`; never `nbpar.pool` or `nbpar.view`. Importing this package
imports nothing else.
"""

from __future__ import annotations


def __getattr__(name):
    if name == "run_training":  # `from nbpar.train import run_training`, as before
        from nbpar.train.loop import run_training

        return run_training
    raise AttributeError(f"module 'nbpar.train' has no attribute {name!r}")
