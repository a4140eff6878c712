"""Golden loss curves: what the shipped tiny recipes train to, committed before a refactor.

`cases.py` names each curve (recipe, ranks, layout); `regenerate.py` rewrites the JSON files
on purpose; `tests/distributed/test_golden_curves.py` compares a fresh run with them.
"""
