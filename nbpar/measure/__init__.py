"""The meters: what a rank holds (`holdings`, `memtrack`), what it sends and how long
(`comm`, `metrics`), the pipeline's timeline (`timeline`) and the step's shares
(`step_split`).

Imports only `nbpar.device`, `nbpar.errors` and `nbpar.model`. Importing this package
imports nothing.
"""
