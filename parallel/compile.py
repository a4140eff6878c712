"""torch.compile per transformer block and for the loss (regional compilation).

Each block's `forward` is replaced on the instance by its compiled version, so parameter
names stay those of the plain model (checkpoints do not depend on compile), recompute (which
wraps `forward` the same way, earlier) ends up inside the compiled region, and FSDP's hooks,
which run around `forward` in `Module.__call__`, stay outside it. The blocks share one code
object, so dynamo compiles their forward once per distinct guard set, not once per layer.

Compilation is lazy: dynamo traces and the backend compiles at the first call. That first
call is guarded; a compile failure names the block (or the loss) and either stops the run
or, with `compile.fallback=true`, runs that region eagerly from then on and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pretrain.core.schema import CompileConfig
from pretrain.models.moe import MoEFeedForward


class CompileError(RuntimeError):
    """A region that failed to compile, in a recipe that does not allow the eager fallback."""


class GuardedCompile:
    """A compiled function whose first call checks that compilation succeeded.

    After the first call it dispatches straight to the compiled function, or to the eager
    one when compilation failed and the fallback is allowed.
    """

    def __init__(self, name: str, eager: Callable, cfg: CompileConfig) -> None:
        """Compile `eager` (lazily) with the recipe's backend; `name` is used in messages."""
        self.name = name
        self.eager = eager
        self.compiled = torch.compile(eager, backend=cfg.backend, fullgraph=True)
        self.fallback = cfg.fallback
        self.fell_back = False
        self._call: Callable | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._call is not None:
            return self._call(*args, **kwargs)
        # Imported here: torch._dynamo costs every rank about 0.9 s of start-up, and a run
        # without compile never needs it.
        from torch._dynamo.exc import TorchDynamoException

        try:
            out = self.compiled(*args, **kwargs)
        except TorchDynamoException as error:
            summary = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
            if not self.fallback:
                raise CompileError(
                    f"torch.compile failed for {self.name} ({summary}); set "
                    "compile.fallback=true to run it eagerly, or compile.enabled=false"
                ) from error
            print(
                f"[compile] {self.name} failed to compile ({summary}); running it eagerly "
                "because compile.fallback=true",
                file=sys.stderr,
                flush=True,
            )
            self.fell_back = True
            self._call = self.eager
            # Blocks have no side effects, so the failed attempt leaves nothing to undo.
            return self.eager(*args, **kwargs)
        self._call = self.compiled
        return out


def apply_compile(
    model: nn.Module,
    cfg: CompileConfig,
    context_parallel: bool = False,
    split_backward: bool = False,
) -> None:
    """Compile each transformer block's forward in place, if the recipe asks for it; of a
    block with routed experts, its attention alone; under context parallelism, its
    feed-forward alone (and of a block with routed experts under it, nothing).

    Under a schedule that splits each backward into an input-gradient pass and a weight pass
    (zero_bubble, zbv, dualpipev), both passes go through a compiled region's one backward
    node with the graph retained, which AOTAutograd's donated buffers refuse ('compiled with
    non-empty donated buffers ... requires retain_graph=False', torch 2.13): they are turned
    off, and each pass runs the region's whole backward (the plan says so and costs it).

    The experts' dispatch cannot be one graph: its sizes are the tokens each expert got
    (data-dependent), it asks autograd whether it is being recomputed, and it accumulates the
    routing statistics in place, all of which fullgraph tracing refuses (torch 2.13). The
    attention, most of such a block's FLOPs at short sequence lengths, compiles as a dense
    block does; the router and experts run eagerly (their grouped GEMM is one kernel anyway).
    Context parallelism's ring attention exchanges K/V blocks point to point, which dynamo
    cannot trace ('P2P compilation disabled for P2POp construction', torch 2.13): the ring
    stays eager, its steps being SDPA kernels already, and the feed-forward (two thirds of a
    dense block's FLOPs) compiles.
    """
    if not (cfg.enabled and cfg.blocks):
        return
    if split_backward:
        import torch._functorch.config

        torch._functorch.config.donated_buffer = False
    for key, block in model.layers.items():
        moe = isinstance(block.feed_forward, MoEFeedForward)
        if moe and context_parallel:
            continue
        if moe:
            region, name = block.attention, f"attention of block layers.{key}"
        elif context_parallel:
            region, name = block.feed_forward, f"feed-forward of block layers.{key}"
        else:
            region, name = block, f"block layers.{key}"
        region.forward = GuardedCompile(name, region.forward, cfg)


def compile_loss(loss_fn: Callable, cfg: CompileConfig) -> Callable:
    """`loss_fn` compiled if the recipe asks for it, else `loss_fn` itself."""
    if not (cfg.enabled and cfg.loss):
        return loss_fn
    return GuardedCompile("the loss", loss_fn, cfg)


class CompileCounts(NamedTuple):
    """What dynamo has compiled in this process so far."""

    graphs: int
    """Graphs compiled (each region once per guard set; a recompile adds one)."""
    graph_breaks: int
    """Graph breaks met while tracing (a fullgraph region raises instead)."""
    seconds: float
    """Time spent compiling: tracing, AOTAutograd and the backend, forward and backward."""


COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
"""dynamo's timers of one compilation (`torch._dynamo.utils.compilation_time_metrics`):
the frame's (tracing, AOTAutograd, the forward's backend compile) and the backward graph's,
which inductor compiles at the first backward."""


def compile_counts() -> CompileCounts:
    """Dynamo's counters for this process: zeros where dynamo was never imported (a run
    without compile does not pay for the import)."""
    if "torch._dynamo" not in sys.modules:
        return CompileCounts(0, 0, 0.0)
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(key, ())) for key in COMPILE_TIMERS)
    return CompileCounts(
        graphs=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
        seconds=seconds,
    )
