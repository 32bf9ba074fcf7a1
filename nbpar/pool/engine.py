"""Entry point of an nbpar engine process: an ipyparallel engine that starts
importing torch the moment it starts, while it registers with the controller.

Started as ``python -m nbpar.pool.engine <ipengine args>``; importing torch takes
~1.5-2 s, about as long as registration, so the two overlap.

It exits with the process that started it, unless that process starts it detached
on purpose and exits (ipyparallel's SSH launcher does, on the remote host): the
launcher then says so in `DETACHED`, and the engine stays.
"""

import os
import threading

#: set (to "1") in an engine's environment by a launcher that detaches its engines
DETACHED = "NBPAR_ENGINE_DETACHED"


def _warm_imports():
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # the engine reports import errors when a cell needs torch
        pass


if __name__ == "__main__":
    from nbpar.pool.orphan import exit_with_parent

    if os.environ.get(DETACHED) != "1":
        exit_with_parent()
    threading.Thread(target=_warm_imports, name="nbpar-warm-imports", daemon=True).start()
    from ipyparallel.engine.app import main

    main()
