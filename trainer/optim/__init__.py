"""Optimizers, their state dtypes and the learning-rate schedule."""
