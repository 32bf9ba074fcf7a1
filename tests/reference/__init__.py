"""Reference models, batches and single-process losses shared by the strategy tests."""
