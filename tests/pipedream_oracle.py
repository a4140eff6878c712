"""PipeDream-2BW run in one process over the real stage modules, and the synchronous run of
the same recipe beside it: the reference the distributed 2BW run must reproduce, and the
two curves of the convergence comparison (tests, `bench/pipedream_convergence.py`).

The stages are split, initialized and fed as the trainer does (same weights, data order,
optimizer groups, LR schedule, clipping); the 2BW engines of all stages run in one process
(`pretrain.parallel.pipeline.pipedream.run_local`), and one optimizer over every stage's
newest version applies each step's gradient one step late (a tied embedding's and its
copy's summed); the validation loss runs the newest version of every stage in order. Only
fp32 layouts without tp, cp or dp replicas are simulated (what a reference needs).
"""

from __future__ import annotations

import torch

from pretrain import models
from pretrain.core.layout import Degrees, grad_accum_steps
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.materialize import materialize
from pretrain.parallel.pipeline.pipedream import (
    LocalTransport,
    PipeDream,
    Version,
    local_step,
    move_optimizer,
)
from pretrain.parallel.pipeline.stages import StageView, split_stage
from pretrain.parallel.pipeline.tied_embedding import mark_head_copy, reduce_tied_grads
from pretrain.parallel.precision import LossScaler
from pretrain.trainer.data.loader import (
    DataLoader,
    RunData,
    one_process_loader,
    open_datasets,
    packed_data,
    train_loader,
    val_loader,
)
from pretrain.trainer.optim.lr_schedule import build_lr_scheduler
from pretrain.trainer.optim.optimizers import build_optimizer
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import apply_gradients, train_step
from pretrain.trainer.step.state import TrainState, lm_loss

Curve = list[tuple[float, float]]
"""(loss, grad norm) per step; the norm is NaN in a step that applied no update."""

ONE_RANK = Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=1, ep=1, world=1)
CPU = torch.device("cpu")


def _loader(cfg: RecipeConfig) -> DataLoader:
    return one_process_loader(cfg)


def _state(cfg: RecipeConfig, view: torch.nn.Module) -> TrainState:
    optimizer = build_optimizer(view, cfg.optim, global_batch=cfg.train.global_batch, device=CPU)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.schedule, cfg.train.steps)
    return TrainState(view, view, optimizer, scheduler, LossScaler(cfg.precision))


def synchronous_curve(cfg: RecipeConfig, steps: int) -> Curve:
    """The recipe trained by one process, one update per step (what 1F1B computes)."""
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model)
    materialize(model, cfg.model, cfg.seed, CPU)
    state, loader = _state(cfg, model), _loader(cfg)
    curve = []
    for _ in range(steps):
        loss, norm, _, _ = train_step(StepContext(state, cfg, ONE_RANK, CPU), loader.next_step())
        curve.append((loss.item(), norm.item()))
    return curve


def _stage(cfg: RecipeConfig, stage: int) -> torch.nn.Module:
    module = split_stage(models.build(cfg.model), stage, cfg.parallel)
    mark_head_copy(module)
    materialize(module, cfg.model, cfg.seed, CPU)
    return module


def pipedream_curve(cfg: RecipeConfig, steps: int) -> Curve:
    """The recipe trained by PipeDream-2BW over `parallel.pp` stages in one process."""
    return pipedream_run(cfg, steps)[0]


def pipedream_run(cfg: RecipeConfig, steps: int) -> tuple[Curve, list[float]]:
    """`pipedream_curve`, and the validation loss at the steps the trainer evaluates
    (`eval.every` and the last), of the weights the next step runs on: the newest version
    of every stage after the step's update (the first step's, which applies none: the
    initial weights). Under `data.doc_mask` every stage's forward takes the documents."""
    torch.manual_seed(cfg.seed)
    pp = cfg.parallel.pp
    m = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    versions = [[Version(_stage(cfg, s)) for s in range(pp)] for _ in range(2)]
    state = _state(cfg, StageView([v.module for v in versions[1]]))
    data = packed_data(cfg, open_datasets(cfg, is_main=True, report=print))
    loader = train_loader(cfg, data, dp_rank=0, dp_size=1)
    ctx = StepContext(state, cfg, ONE_RANK, CPU, doc_eos=data.eos_id if cfg.data.doc_mask else None)
    owner = [p for v in versions[1] for p in v.params]
    newest = [v.module for v in versions[1]]
    finished: list[Version] = []
    mailbox: dict = {}
    engines = [
        PipeDream(
            (versions[0][s], versions[1][s]),
            pp,
            s,
            m,
            lambda logits, targets: lm_loss(logits, targets) / m,
            LocalTransport(mailbox, s),
            lambda target, source: finished.append(target),
        )
        for s in range(pp)
    ]
    curve, val = [], []
    previous = torch.zeros(())
    for step in range(1, steps + 1):
        batch = loader.next_step()
        inputs = torch.tensor_split(torch.cat([x for x, _ in batch]), m)
        targets = torch.tensor_split(torch.cat([y for _, y in batch]), m)
        kwargs = [ctx.model_kwargs(x) for x in inputs]
        losses = local_step(engines, list(inputs), list(targets), kwargs)
        loss = torch.stack([x.detach() for x in losses]).sum()
        norm = torch.tensor(float("nan"))
        if finished:
            target = [p for v in finished for p in v.params]
            move_optimizer(state.optimizer, owner, target)
            owner = target
            newest = [v.module for v in finished]
            state.plain = StageView(newest)
            # A tied embedding and the last stage's copy of it take their summed gradient.
            reduce_tied_grads(state.plain, None)
            # The update is the previous step's: its loss decides whether it was bad.
            norm = apply_gradients(state, cfg, None, previous)[0]
            finished.clear()
        curve.append((loss.item(), norm.item()))
        previous = loss
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == steps):
            val.append(_validation_loss(ctx, newest, data))
    return curve, val


@torch.no_grad()
def _validation_loss(ctx: StepContext, stages: list[torch.nn.Module], data: RunData) -> float:
    """The mean loss of `eval.batches` validation batches through `stages` in order."""
    cfg = ctx.cfg
    loader = val_loader(cfg, data, dp_rank=0, dp_size=1)
    assert loader is not None, "the recipe has no validation split"
    total = 0.0
    for index in range(cfg.eval.batches):
        batch = loader.batches(index)
        for inputs, targets in batch:
            hidden = inputs
            for stage in stages:
                hidden = stage(hidden, **ctx.model_kwargs(inputs))
            total += lm_loss(hidden, targets).item() / len(batch)
    return total / cfg.eval.batches
