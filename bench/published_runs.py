"""The planner against published runs: the table docs/planning.md shows.

For every case of tests/unit/test_published_layouts.py: the published layout and figure, the
cost model's prediction for that layout (its unstated fields at the search's fastest choice),
their ratio, where the published tp x pp ranks among the search's fitting layouts, and the
search's wall time.

    PYTHONPATH=. python bench/published_runs.py [CASE ...]
"""

from __future__ import annotations

import sys
import time

from pretrain.launcher.plan.suggest import search
from tests.unit.test_published_layouts import CASES, fastest_published, search_rank, throughput


def main(names: list[str]) -> None:
    print("| run | published | predicted | ratio | rank of its tp x pp | search s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        if names and case.name not in names:
            continue
        cfg = case.recipe()
        start = time.perf_counter()
        result = search(cfg)
        seconds = time.perf_counter() - start
        published = fastest_published(result, case)
        predicted = throughput(cfg, published, case.measure)
        unit = "tok/s/GPU" if case.measure == "tokens" else case.measure.upper()
        shown = f"{{:.{0 if case.measure == 'tokens' else 3}f}}"
        print(
            f"| {case.name} | {shown.format(case.published)} {unit} | "
            f"{shown.format(predicted)} | {predicted / case.published:.2f} | "
            f"{search_rank(result, case)} of {len(result.ranked)} | {seconds:.1f} |",
            flush=True,
        )
        print(f"    published layout as costed: {published.layout}; {published.why()}")


if __name__ == "__main__":
    main(sys.argv[1:])
