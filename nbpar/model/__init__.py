"""What to train: built-in models, Hugging Face families, the registry of names and
``"pkg.mod:function"`` strings, parallel plans, data sets and learning-rate schedules.

The bottom layer beside `nbpar.device` and `nbpar.errors`: it imports nothing else of nbpar.
Importing this package imports nothing.
"""
