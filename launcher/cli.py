"""The `pretrain` command: compose a recipe with Hydra, validate, plan, then act.

    pretrain --config-name RECIPE key=value +key=value ~key group=option [-m] [--cfg job]

`action=run` (default) writes the run dir and launches (torchrun here, or sbatch);
`action=plan` prints the plan and writes nothing; `action=script` writes the run dir and
the job script and launches nothing; `action=suggest` lists the fastest layouts that fit;
`action=prepare` tokenizes the data into prepared datasets (here, or as a SLURM CPU job);
`action=dryrun` builds one rank and runs one step under fake collectives and fake tensors;
`action=calibrate` measures the hardware's rates on the job's ranks (here, or submitted) for
the plan and the layout search. Nothing here imports torch, so the command starts fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pretrain.core.inputs.boundary import run_command
from pretrain.core.problems import RecipeError
from pretrain.core.run.rundir import PREEMPTED_MARKER
from pretrain.core.run.wandb_credentials import wandb_project
from pretrain.core.schema import RecipeConfig, dump_config, schema_node, to_recipe
from pretrain.launcher.assets import SHIPPED_RECIPES
from pretrain.launcher.compose.command_line import (
    checked_command_line,
    flags_first,
    hydra_errors_as_problems,
    search_dirs,
    sweep_scratch,
    with_user_recipes,
)
from pretrain.launcher.compose.sweep_settings import CONFIRM_FLAG
from pretrain.launcher.help import render_help
from pretrain.launcher.job.sweep import (
    OUTCOMES,
    SWEPT_KEYS,
    Failed,
    Stopped,
    final_loss,
    point_dir_name,
    run_point,
    summary,
    swept_keys,
)
from pretrain.launcher.output import (
    QUIET_FLAGS,
    VERBOSE_FLAGS,
    get_logger,
    info_stream,
    levels_of_one_command,
    set_verbosity,
)

LOG = get_logger(__name__)

RECIPES_DIR = str(SHIPPED_RECIPES)
DEFAULT_RECIPE = "tiny"

ConfigStore.instance().store(name="recipe_schema", node=schema_node())
# recipes/base.yaml puts a sweep's own record (multirun.yaml, Optuna's results) in the
# sweep's folder: run.dir when given, else runs/<recipe>, as the points' run dirs are.
OmegaConf.register_new_resolver(
    "sweep_dir", lambda run_dir, name: run_dir or f"runs/{name}", replace=True
)


def _run_dir(cfg: RecipeConfig) -> Path:
    """The run dir: `run.dir`, else runs/<name>; in a sweep, below it the override string."""
    # A calibration's job gets a run dir of its own beside the recipe's runs.
    default = cfg.name + ("-calibration" if cfg.action == "calibrate" else "")
    run_dir = Path(cfg.run.dir).expanduser() if cfg.run.dir else Path("runs") / default
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg and hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        run_dir = run_dir / point_dir_name(
            hydra_cfg.job.override_dirname, list(hydra_cfg.overrides.task), hydra_cfg.job.num
        )
    return run_dir.resolve()


def _fail(message: str, code: int = 2) -> None:
    LOG.error(message)
    raise Failed(code, message)


def execute(cfg: RecipeConfig, launched: dict | None = None) -> float | None:
    """Validate, plan and carry out `cfg.action` for one composed recipe; the final
    validation (or training) loss of a local run, None for the other actions. `launched`
    (the recipe's name and the command line's overrides) goes to RUN_DIR/overrides.yaml."""
    from pretrain.core.timeouts import first_step_timeout
    from pretrain.launcher.compose.from_hf import adopted_lines
    from pretrain.launcher.compose.nanogpt_split import nanogpt_val_lines
    from pretrain.launcher.plan.plan import make_plan, plan_to_dict
    from pretrain.launcher.plan.report.render import render_plan, render_summary
    from pretrain.launcher.validate.schedules import fit_schedule_to_run

    overrides = (launched or {}).get("overrides", [])
    try:
        for line in [*adopted_lines(cfg, overrides), *nanogpt_val_lines(cfg, overrides)]:
            LOG.info(line)
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    for warning in fit_schedule_to_run(cfg):
        LOG.warning(warning)
    if cfg.action == "suggest":
        # The search chooses the layout: only problems that no layout fixes are refused.
        from pretrain.launcher.plan.suggest import report

        try:
            print(report(cfg))
        except RecipeError as err:
            _fail(f"Recipe '{cfg.name}' cannot be searched:\n{err}")
        return None
    if cfg.action == "prepare":
        _prepare(cfg)
        return None
    if cfg.plan.chart == "png" and cfg.action != "plan":
        _fail(f"plan.chart=png: the chart is drawn by action=plan, not action={cfg.action}; "
              "add action=plan, or drop plan.chart")  # fmt: skip
    _validate_for_action(cfg)
    plan = make_plan(cfg)
    if cfg.action == "plan":
        if cfg.plan.format == "json":
            print(json.dumps(plan_to_dict(plan)))
        else:
            print(render_plan(plan))
        if cfg.plan.chart == "png":
            _draw_pipeline_chart(cfg, plan)
        return None
    if cfg.action == "dryrun":
        from pretrain.launcher.plan.dryrun import dry_run_action

        _fail_on(dry_run_action(cfg, plan))
        return None
    if cfg.action == "calibrate":
        _calibrate(cfg, plan_to_dict(plan), launched)
        return None
    # The plan before a job is said, not produced: -q hides it, never its warnings.
    if cfg.plan.before_run == "full":
        LOG.info(render_plan(plan, with_warnings=False))
    elif cfg.plan.before_run == "summary":
        LOG.info(render_summary(plan))
    for warning in plan.warnings:
        LOG.warning(warning)
    if cfg.plan.dryrun and cfg.action == "run" and cfg.cluster.backend == "slurm":
        from pretrain.launcher.plan.dryrun import refusal

        _fail_on(refusal(cfg, plan))
    # The ranks read the first steps' timeout from the config: the plan is the launcher's.
    cfg.faults.first_step_timeout_s = first_step_timeout(
        cfg.faults, plan.step_time_s, cfg.compile.enabled
    )
    return _write_and_start(cfg, plan_to_dict(plan), launched)


def _calibrate(cfg: RecipeConfig, plan: dict, launched: dict | None) -> None:
    """action=calibrate: check every layout it times, run the probe on the job's ranks (here,
    or submitted), then say each layout's calibrated prediction against its measured step."""
    from pretrain.core.calibration import calibration_path, layout_variants
    from pretrain.launcher.plan.calibrated import probe_spec
    from pretrain.launcher.plan.memory_fit import check_fits
    from pretrain.launcher.validate.recipe import validate

    try:
        variants = layout_variants(cfg)
        for _, variant in variants[1:]:
            validate(variant)
            check_fits(variant)
    except ValueError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}': a layout of calibrate.layouts is not valid:\n{err}")
    plan["calibration_probe"] = probe_spec([variant for _, variant in variants])
    plan["calibration_layouts"] = [overrides for overrides, _ in variants]
    _write_and_start(cfg, plan, launched)
    if cfg.cluster.backend == "local":
        from pretrain.launcher.plan.calibrated import render_calibration

        print(render_calibration(cfg, calibration_path(cfg)))


def _fail_on(problem: str | None) -> None:
    if problem:
        _fail(problem)


def _draw_pipeline_chart(cfg: RecipeConfig, plan: Any) -> None:
    """plan.chart=png: the simulated schedule of `plan` (launcher/plan/plan.py's Plan) as
    pipeline.png here, said on stderr, so that a JSON plan on stdout stays one object."""
    from pretrain.launcher.plan.report.chart_png import draw_chart

    if plan.pipeline is None:
        _fail(f"plan.chart=png: recipe '{cfg.name}' has parallel.pp=1 and no pipeline to "
              "chart; set parallel.pp > 1, or drop plan.chart")  # fmt: skip
    out = draw_chart(plan.pipeline, Path("pipeline.png"), cfg.name)
    LOG.info(f"pipeline chart: {out.resolve()}")


def _validate_for_action(cfg: RecipeConfig) -> None:
    """Every check the action needs, before anything is written; exits on a problem."""
    from pretrain.core.problems import Checks
    from pretrain.launcher.plan.memory_fit import check_fits
    from pretrain.launcher.validate.data import unprepared_problems
    from pretrain.launcher.validate.job_limits import check_disk_room
    from pretrain.launcher.validate.layout import check_runnable
    from pretrain.launcher.validate.recipe import validate

    try:
        launch = cfg.action == "run"
        here = launch and cfg.cluster.backend == "local"
        writes = cfg.action in ("run", "script", "calibrate")
        validate(cfg, for_launch=launch, run_dir=writes, here=here)
        if cfg.action not in ("plan", "dryrun"):
            # A job that would run out of memory is refused before it is written or submitted.
            check_fits(cfg)
        if writes and cfg.cluster.backend == "slurm":
            _check_partition(cfg)
            _check_shrinks(cfg)
        if cfg.action == "run" and cfg.cluster.backend == "slurm":
            # GPU nodes never tokenize: the data is prepared first, by its own CPU job.
            problems = unprepared_problems(cfg)
            if problems:
                raise RecipeError(problems)
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    if cfg.action == "script":
        # A script may be written for a layout this trainer cannot run yet, or for a run dir
        # that has no room for its checkpoints yet; say so loudly.
        room = Checks()
        check_disk_room(room, cfg)
        for problem in [*check_runnable(cfg), *room.problems]:
            LOG.warning(problem)


def _check_shrinks(cfg: RecipeConfig) -> None:
    """Every node count the job may shrink to has a layout (RecipeError naming
    cluster.min_nodes otherwise); says which."""
    from pretrain.launcher.plan.shrink import shrink_summary

    for line in shrink_summary(cfg):
        LOG.info(f"if nodes are lost, {line}")


def _check_partition(cfg: RecipeConfig) -> None:
    """The job's request against its partition's limits (RecipeError); a line on stderr
    when SLURM cannot tell them here."""
    from pretrain.core.problems import Checks
    from pretrain.launcher.validate.job_limits import check_partition

    c = Checks()
    skipped = check_partition(c, cfg)
    if skipped:
        print(f"note: {skipped}", file=sys.stderr)
    c.raise_if_any()


def _write_and_start(cfg: RecipeConfig, plan: dict, launched: dict | None) -> float | None:
    """Claim and write the run dir, then run locally or submit (action run or script); the
    final loss of a local run."""
    from pretrain.core.run.goodput import append_event
    from pretrain.launcher.job.backends import (
        LaunchError,
        claimed_run_dir,
        never_starts,
        run_local,
        submit_slurm,
    )
    from pretrain.launcher.job.failure_summary import failure_message
    from pretrain.launcher.job.run_dir import (
        JobError,
        check_run_dir,
        finished_message,
        write_run_dir,
    )

    config_yaml = dump_config(cfg)
    try:
        check_run_dir(cfg, Path(cfg.run.dir), config_yaml)  # refuse before anything is written
        finished = finished_message(cfg, Path(cfg.run.dir)) if cfg.action == "run" else None
        if finished:
            LOG.warning(finished)
            return final_loss(Path(cfg.run.dir))
        with claimed_run_dir(cfg) as lock_token:
            files = write_run_dir(cfg, Path(cfg.run.dir), config_yaml, plan, launched)
            LOG.info(f"run dir:    {files.run_dir}")
            LOG.info(f"config:     {files.config_path}")
            if cfg.action == "script":
                # The script's path alone on stdout: `sbatch $(pretrain -q action=script)`.
                print(files.script_path)
                return None
            LOG.info(f"job script: {files.script_path}")
            if cfg.cluster.backend == "slurm":
                job = submit_slurm(files)
                print(f"submitted SLURM job {job.job_id}; log: {job.log_path}")
                # The controller judges a job when it is submitted: one it can never start
                # is said so now, not found pending days later (if it can be asked).
                with contextlib.suppress(LaunchError):
                    cannot_start = never_starts(job.job_id)
                    if cannot_start:
                        _fail(cannot_start)
                return None
            ended = run_local(files, cfg, lock_token)
            # The end of the job for the goodput account: the ranks' teardown included.
            with contextlib.suppress(OSError):  # an account short of it is no failure
                append_event(files.run_dir, {"event": "job_end", "code": ended.code})
    except (JobError, LaunchError) as err:
        _fail(str(err))
    if ended.stopped_by:
        resume = "run the same command again to resume"
        LOG.warning(f"stopped by {ended.stopped_by}; {resume}")
        # Ranks that saved and left the preempted marker stopped as asked (as a requeued
        # SLURM job does): exit 0. A stop before that is not finished: exit as a shell
        # reports a signal, 128 + its number. Either way a sweep stops here.
        saved = ended.code == 0 and (files.run_dir / PREEMPTED_MARKER).is_file()
        raise Stopped(0 if saved else 128 + signal.Signals[ended.stopped_by].value)
    if ended.code != 0:
        _fail(failure_message(files.run_dir, ended.code), ended.code)
    return final_loss(files.run_dir)


def _prepare(cfg: RecipeConfig) -> None:
    """Validate the data fields (and, locally, the files), then prepare or submit."""
    from pretrain.core.problems import RecipeError
    from pretrain.core.run.run_lock import RunDirInUse, check_free
    from pretrain.launcher.job.backends import LaunchError
    from pretrain.launcher.job.prepare import run_prepare_here, submit_prepare, write_prepare_files
    from pretrain.launcher.job.run_dir import JobError
    from pretrain.launcher.validate.data import prepare_problems
    from pretrain.launcher.validate.recipe import validate

    try:
        validate(cfg)
        problems = prepare_problems(cfg)
        if problems:
            raise RecipeError(problems)
        if cfg.cluster.backend == "local":
            check_free(Path(cfg.run.dir))  # refused before anything is written
        files = write_prepare_files(cfg, Path(cfg.run.dir))
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    except JobError as err:
        _fail(str(err))
    except RunDirInUse as err:
        _fail(f"run.dir: {err}")
    LOG.info(f"config:     {files.config_path}")
    if cfg.cluster.backend == "slurm":
        try:
            job = submit_prepare(files)
        except LaunchError as err:
            _fail(str(err))
        print(f"submitted SLURM job {job.job_id} (prepare); log: {job.log_path}")
        return
    try:
        code, stopped_by = run_prepare_here(files)
    except LaunchError as err:
        _fail(f"run.dir: {err}")
    if stopped_by:
        LOG.warning(f"stopped by {stopped_by}; finished units are kept, run the same command "
                    "again to resume")  # fmt: skip
        raise Stopped(128 + signal.Signals[stopped_by].value)
    if code != 0:
        _fail(f"preparation exited with code {code}; see the output above", code)


@hydra.main(config_path=RECIPES_DIR, config_name=DEFAULT_RECIPE, version_base=None)
def _hydra_main(node: DictConfig) -> float | None:
    cfg = to_recipe(node)
    cfg.run.dir = str(_run_dir(cfg))
    cfg.logging.wandb_project = wandb_project(cfg.logging.wandb_project)
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    launched = {"recipe": hydra_cfg.job.config_name, "overrides": overrides}
    LOG.debug(f"recipe {launched['recipe']}, overrides: {shlex.join(overrides) or '(none)'}")
    if hydra_cfg.mode is None or hydra_cfg.mode.name != "MULTIRUN":
        return execute(cfg, launched)
    if "optuna" in str(hydra_cfg.sweeper.get("_target_", "")):
        _refuse_blind_search(cfg)
    maximize = "max" in str(getattr(hydra_cfg.sweeper, "direction", ""))
    swept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in SWEPT_KEYS]
    point = " ".join(swept or overrides)
    # One W&B group per sweep, each point named by what it changes.
    cfg.logging.wandb_name = cfg.logging.wandb_name or f"{cfg.name} {point}"[:128]
    group = f"{cfg.name}:{','.join(sorted(SWEPT_KEYS)) or 'sweep'}"
    cfg.logging.wandb_group = cfg.logging.wandb_group or group[:128]
    return run_point(hydra_cfg.job.num, point, lambda: execute(cfg, launched), maximize)


def _refuse_blind_search(cfg: RecipeConfig) -> None:
    """An Optuna search picks each trial from the losses of the ones before: a trial that
    is not trained here and now (a SLURM job, a script, a plan) has none, and every trial
    would score the worst value. Refused before its first trial."""
    if cfg.action == "run" and cfg.cluster.backend == "local":
        return
    where = (
        f"cluster.backend={cfg.cluster.backend}" if cfg.action == "run" else f"action={cfg.action}"
    )
    _fail(
        f"hydra/sweeper=optuna with {where}: an Optuna search needs each trial's final loss "
        "before it picks the next, and these trials train nothing here to report one; run "
        "the search here (cluster.backend=local, action=run), or sweep a grid of points "
        "(-m optim.lr=1e-4,3e-4,1e-3), which runs on SLURM as one job per point"
    )


def _wants_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def _help_filter(argv: list[str]) -> str:
    """`pretrain --help cluster`: the word after --help narrows the fields listed."""
    flag = argv.index("--help") if "--help" in argv else argv.index("-h")
    rest = argv[flag + 1 : flag + 2]
    return rest[0] if rest and "=" not in rest[0] and not rest[0].startswith("-") else ""


SUBCOMMANDS = ("status", "diff", "report", "export", "dashboard")
"""`pretrain COMMAND ...`: the commands besides the recipe's actions; report, export and
dashboard are also installed as `pretrain-COMMAND`, and take the same arguments either way."""


def run_subcommand(name: str, argv: list[str]) -> int:
    """Run `pretrain NAME ARGV`; its exit code."""
    if name == "export":
        # The exporter is the trainer's (it loads the checkpoint with torch), and the
        # launcher imports no trainer code: the process becomes the exporter instead.
        os.execv(
            sys.executable, [sys.executable, "-m", "pretrain.trainer.checkpoint.export", *argv]
        )
    if name == "status":
        from pretrain.launcher.job.status import main as status

        return status(argv)
    if name == "diff":
        from pretrain.launcher.job.diff import main as diff

        return diff(argv)
    if name == "report":
        from pretrain.launcher.report import main as command
    else:
        from pretrain.launcher.dashboard import main as command
    command(argv)
    return 0


def version_line() -> str:
    """`pretrain --version`: this package's version and those of what it drives (Hydra's own
    `--version` would print Hydra's alone)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"pretrain {installed('pretrain')} (torch {installed('torch')}, "
        f"hydra-core {installed('hydra-core')}, Python {sys.version.split()[0]})"
    )


def main() -> None:
    """Console entry point of `pretrain` (and of `pretrain COMMAND`), inside the error
    boundary: a user error exits 2, Ctrl-C 130, a bug 1 with its traceback saved, never
    shown."""
    if "--version" in sys.argv[1:]:
        print(version_line())
        return
    # `pretrain -q status RUN` and `pretrain status -q RUN` alike: the command's own main
    # reads the flag.
    words = [a for a in sys.argv[1:] if a not in QUIET_FLAGS + VERBOSE_FLAGS]
    with levels_of_one_command():
        if words[:1] and words[0] in SUBCOMMANDS:
            name, rest = words[0], list(sys.argv[1:])
            rest.remove(name)
            run_command(f"pretrain {name}", lambda: run_subcommand(name, rest))
        run_command("pretrain", _main)


def _main() -> None:
    """The command line and recipe files are checked before Hydra composes, and Hydra's
    errors are reported like the validator's."""
    confirmed = CONFIRM_FLAG in sys.argv[1:]  # a large sweep's go-ahead; not Hydra's flag
    try:
        ours = set_verbosity([a for a in sys.argv[1:] if a != CONFIRM_FLAG])
        argv = with_user_recipes(flags_first(ours))
        if _wants_help(argv):
            print(render_help(search_dirs(argv), _help_filter(argv)))
            return
        with sweep_scratch(argv, DEFAULT_RECIPE) as scratch:
            sys.argv[1:] = checked_command_line(argv, DEFAULT_RECIPE, confirmed) + scratch
            LOG.debug(f"Hydra's command line: {shlex.join(sys.argv[1:])}")
            # One command, one sweep: nothing of an earlier main() in this process counts.
            OUTCOMES.clear()
            SWEPT_KEYS.clear()
            SWEPT_KEYS.update(swept_keys(sys.argv[1:]))
            with hydra_errors_as_problems():
                _hydra_main()
    except RecipeError as err:
        _fail(f"The command line or a recipe is not valid:\n{err}")
    if OUTCOMES:
        LOG.info(summary(OUTCOMES, info_stream()))
        if not all(o.ok for o in OUTCOMES):
            raise SystemExit(1)
