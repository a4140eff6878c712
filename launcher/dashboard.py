"""`pretrain-dashboard --project P [--entity E]`: a saved W&B workspace for a project, with
the panels pretraining runs are watched by (built with wandb-workspaces).

The panels are data (`SECTIONS`), so the spec can be printed and checked offline
(`--print`): every key they plot is one the trainer logs (a test reads the keys back from
an offline run's .wandb file). Creating the workspace needs W&B credentials; without them
the command says so and exits 2 after printing the spec.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from pretrain.launcher.output import get_logger, levels_of_one_command, set_verbosity

LOG = get_logger(__name__)

STEP = "train/step"
"""The x-axis of every line panel: the trainer's step metric."""


@dataclass(frozen=True)
class Panel:
    """One panel: a line plot of `y` against the step, or (`summary`) a scatter plot of two
    summary values per run, x against y (predicted against measured)."""

    title: str
    y: tuple[str, ...]
    summary: bool = False


SECTIONS: dict[str, tuple[Panel, ...]] = {
    "Throughput": (
        Panel("MFU", ("perf/mfu",)),
        Panel("HFU", ("perf/hfu",)),
        Panel("TFLOP/s per device", ("perf/tflops_per_device",)),
        Panel("tokens/s", ("perf/tokens_per_s",)),
        Panel("step time (s)", ("perf/step_time_s", "time/data_wait_s")),
        Panel("predicted vs measured MFU", ("plan/mfu", "perf/mfu"), summary=True),
        Panel(
            "predicted vs measured tokens/s",
            ("plan/tokens_per_s", "perf/tokens_per_s"),
            summary=True,
        ),
    ),
    "Loss": (
        Panel("train loss", ("train/loss",)),
        Panel("validation loss", ("val/loss",)),
        Panel("grad norm", ("train/grad_norm",)),
        Panel("learning rate", ("train/lr",)),
        Panel("skipped steps (fp16)", ("train/skipped_steps", "train/loss_scale")),
    ),
    "Memory": (
        Panel("peak memory (GiB)", ("mem/peak_gib",)),
        Panel(
            "predicted vs measured memory (GiB)", ("plan/memory_gib", "mem/peak_gib"), summary=True
        ),
    ),
    "MoE": (
        Panel(
            "tokens per expert",
            (
                "moe/tokens_per_expert_min",
                "moe/tokens_per_expert_mean",
                "moe/tokens_per_expert_max",
            ),
        ),
        Panel("dropped fraction", ("moe/dropped_frac",)),
        Panel("aux and z loss", ("moe/aux_loss", "moe/z_loss")),
    ),
    "Downstream": (
        Panel("task accuracy (mean of eval.tasks)", ("eval/average/acc", "eval/average/acc_norm")),
    ),
    "Stability": (
        Panel("largest attention logit", ("stability/attn_logit_max",)),
        Panel("output logit z-mean", ("stability/z_mean",)),
        Panel("update / weight (largest layer)", ("stability/update_ratio_max",)),
        Panel("gradient norm (largest layer)", ("stability/grad_norm_max",)),
        Panel("block output RMS (largest layer)", ("stability/act_rms_max",)),
        Panel("parameter norm", ("stability/param_norm",)),
    ),
    "Goodput": (
        Panel("goodput (productive / total)", ("goodput/goodput",)),
        Panel(
            "where the time went (s)",
            (
                "goodput/productive_s",
                "goodput/checkpoint_save_s",
                "goodput/checkpoint_load_s",
                "goodput/startup_s",
                "goodput/evaluation_s",
                "goodput/recomputed_s",
                "goodput/failures_s",
                "goodput/queue_s",
                "goodput/between_jobs_s",
            ),
        ),
    ),
}
"""The workspace's sections and their panels."""


def spec() -> dict[str, Any]:
    """The workspace as plain data: {section: [panel, ...]}."""
    return {name: [asdict(p) for p in panels] for name, panels in SECTIONS.items()}


def workspace(entity: str, project: str, name: str) -> Any:
    """The wandb-workspaces Workspace of SECTIONS for `entity/project`."""
    import wandb_workspaces.reports.v2.interface as wr
    import wandb_workspaces.workspaces as ws

    def panel(p: Panel) -> Any:
        if p.summary:
            x, y = (wr.SummaryMetric(k) for k in p.y)
            return wr.ScatterPlot(title=p.title, x=x, y=y)
        return wr.LinePlot(title=p.title, x=STEP, y=list(p.y))

    sections = [
        ws.Section(name=section, panels=[panel(p) for p in panels], is_open=True)
        for section, panels in SECTIONS.items()
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-dashboard`, inside the error boundary."""
    from pretrain.core.inputs.boundary import run_command

    with levels_of_one_command():
        run_command("pretrain-dashboard", lambda: _main(argv))


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="pretrain-dashboard", description=__doc__)
    parser.add_argument(
        "--project",
        default=os.environ.get("WANDB_PROJECT", ""),
        help="W&B project (logging.wandb_project; default: $WANDB_PROJECT)",
    )
    parser.add_argument("--entity", default="", help="W&B entity (default: your API key's)")
    parser.add_argument("--name", default="pretrain", help="name of the saved workspace view")
    parser.add_argument("--print", action="store_true", help="print the spec; create nothing")
    args = parser.parse_args(set_verbosity(sys.argv[1:] if argv is None else argv))
    if args.print:
        print(json.dumps(spec(), indent=1))
        return
    if not args.project:
        parser.error("--project is needed to create the workspace (or --print the spec)")
    from pretrain.core.run.wandb_credentials import api_key_configured

    if not api_key_configured(os.environ):
        why = "no W&B credentials (WANDB_API_KEY or a netrc entry)"
        LOG.error(f"pretrain-dashboard: {why}: `wandb login`, then run it again; --print "
                  "shows the panels")  # fmt: skip
        raise SystemExit(2)
    import wandb

    entity = str(args.entity or wandb.Api().default_entity)
    saved = workspace(entity, args.project, args.name).save()
    print(saved.url)


if __name__ == "__main__":
    main()
