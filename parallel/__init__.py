"""Parallelism applied from outside to the plain model: each module exposes `apply_*`."""
