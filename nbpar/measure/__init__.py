"""The meters: what a rank holds (`holdings`, `memtrack`), what it sends and how long
(`comm`, `metrics`), the pipeline's timeline (`timeline`), the step's shares
(`step_split`), and what a run reports of them, typed (`records`).

Imports only `nbpar.device`, `nbpar.errors` and `nbpar.model`. Importing this package
imports nothing.
"""
