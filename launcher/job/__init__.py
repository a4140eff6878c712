"""Stage 4: the run dir and its job script, and the backends that start it (local, SLURM), sweeps,
status.
"""
