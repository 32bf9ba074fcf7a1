"""What draws, in the kernel and in the browser: the live `dashboard` (its panels drawn
client-side by `livechart` from the steps `live` reads), static matplotlib `panels` and
`plots`, `compare`, the `widgets` (StrategyPicker, with `picker_rules` and
`picker_runs`), `history` (step records grouped
the way every figure reads them), `export` (TensorBoard, Prometheus, W&B) and `teaching`
(the notebooks' figures). Reads what a run published; may import the layers below it
(docs/architecture.md, "Layout"); nothing imports it at import time. Importing this package imports
nothing else.
"""
