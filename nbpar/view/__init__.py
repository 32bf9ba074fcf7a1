"""What draws, in the kernel: the live `dashboard` and its `panels`, static `plots`,
`compare`, the `widgets` (StrategyPicker), `memory_plot` (the estimator's figure),
`history` (step records grouped the way every figure reads them), `export`
(TensorBoard, Prometheus, W&B) and `teaching` (the notebooks' figures and small
experiments). Reads what a run published; may import anything above it, nothing
imports it at import time. Importing this package imports nothing else.
"""
