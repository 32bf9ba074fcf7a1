"""Entry point of the controller of a pool nbpar starts: ipyparallel's
controller, which exits (with its schedulers) when the kernel that started it dies."""

if __name__ == "__main__":
    from nbpar.pool.orphan import exit_with_parent

    exit_with_parent()
    from ipyparallel.controller.app import main

    main()
