"""What a run *is*, shared by the launcher, the trainer and the planner.

The recipe schema (every field, its doc and its allowed values), the problem and error
types, the layout math (degrees, rank groups, gradient accumulation), pipeline stage
splits, the hardware table and the run-dir file names. Torch-free and free of the other
packages of this repo: `launcher/`, `models/`, `parallel/` and `trainer/` import it, never
the other way round (tests/unit/test_imports.py).
"""
