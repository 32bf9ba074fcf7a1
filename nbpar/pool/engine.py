"""Entry point of an nbpar engine process: an ipyparallel engine that starts
importing torch the moment it starts, while it registers with the controller.

Started as ``python -m nbpar.pool.engine <ipengine args>``; importing torch takes
~1.5-2 s, about as long as registration, so the two overlap.
"""

import threading


def _warm_imports():
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # the engine reports import errors when a cell needs torch
        pass


if __name__ == "__main__":
    from nbpar.pool.orphan import exit_with_parent

    exit_with_parent()
    threading.Thread(target=_warm_imports, name="nbpar-warm-imports", daemon=True).start()
    from ipyparallel.engine.app import main

    main()
