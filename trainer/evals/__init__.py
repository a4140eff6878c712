"""Downstream evaluation in the loop: multiple-choice tasks scored through the run's own step
(built-in JSONL tasks, and lm-eval's through a model adapter).
"""
