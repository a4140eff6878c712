"""What torch.compile did in a run: graphs, graph breaks, recompiles and compile time.

A compiled run builds its graphs in the first step (each compiled region once per guard set:
one block graph shared by identical blocks, the loss). A graph compiled by a later training
step is a recompile: a guard failed (a tensor's type or shape, a global state), and the step
paid a compilation and runs a second graph from then on. The watch counts those, says so
once on the console with the way to see the failed guard, and puts the counts beside the
step's metrics. An evaluation's forward runs without gradients, which compiles one more
graph per region at the first evaluation: counted in `compile_graphs`, not as a recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pretrain.parallel.compile import compile_counts
from pretrain.trainer.log import get_logger

T = TypeVar("T")


class CompileWatch:
    """Counts the graphs each training step compiles (`enabled`: the run compiles)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.steps = 0
        self.recompiles = 0
        """Graphs compiled by training steps after the first."""

    def step(self, run: Callable[[], T]) -> T:
        """Run one training step, counting the graphs it compiled."""
        if not self.enabled:
            return run()
        before = compile_counts().graphs
        out = run()
        self.steps += 1
        added = compile_counts().graphs - before
        if self.steps == 1:
            get_logger().info("%s", self.first_step_line())
        elif added:
            if not self.recompiles:
                get_logger().warning(
                    "compile: step %d of this run compiled %d more graph(s) after the first "
                    "step (a guard failed); TORCH_LOGS=recompiles names it",
                    self.steps,
                    added,
                )
            self.recompiles += added
        return out

    def first_step_line(self) -> str:
        """The console's line after the first step: what it compiled and in how long."""
        counts = compile_counts()
        return (
            f"compile: {counts.graphs} graph(s), {counts.graph_breaks} graph break(s), "
            f"{counts.seconds:.1f} s compiling in the first step"
        )

    def metrics(self) -> dict[str, Any]:
        """The counts so far (none without compile): `compile_graphs`,
        `compile_graph_breaks`, `compile_recompiles` and `compile_time_s`."""
        if not self.enabled:
            return {}
        counts = compile_counts()
        return {
            "compile_graphs": counts.graphs,
            "compile_graph_breaks": counts.graph_breaks,
            "compile_recompiles": self.recompiles,
            "compile_time_s": round(counts.seconds, 3),
        }
