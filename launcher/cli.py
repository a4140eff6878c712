"""The `pretrain` command: compose a recipe with Hydra, validate, plan, then act.

    pretrain --config-name RECIPE key=value +key=value ~key group=option [-m] [--cfg job]

`action=run` (default) writes the run dir and launches (torchrun here, or sbatch);
`action=plan` prints the plan and writes nothing; `action=script` writes the run dir and
the job script and launches nothing; `action=suggest` lists the fastest layouts that fit;
`action=prepare` tokenizes the data into prepared datasets (here, or as a SLURM CPU job).
Nothing here imports torch, so the command starts fast.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.assets import SHIPPED_RECIPES
from launcher.compose.command_line import (
    checked_command_line,
    hydra_errors_as_problems,
    search_dirs,
    sweep_scratch,
    with_user_recipes,
)
from launcher.compose.sweep_settings import CONFIRM_FLAG
from launcher.help import render_help
from launcher.job.sweep import (
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
from pretrain_core.inputs.boundary import run_command
from pretrain_core.problems import RecipeError
from pretrain_core.run.rundir import PREEMPTED_MARKER
from pretrain_core.schema import RecipeConfig, dump_config, to_recipe

RECIPES_DIR = str(SHIPPED_RECIPES)
DEFAULT_RECIPE = "tiny"

ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)


def _run_dir(cfg: RecipeConfig) -> Path:
    """The run dir: `run.dir`, else runs/<name>; in a sweep, below it the override string."""
    run_dir = Path(cfg.run.dir).expanduser() if cfg.run.dir else Path("runs") / cfg.name
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg and hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        run_dir = run_dir / point_dir_name(
            hydra_cfg.job.override_dirname, list(hydra_cfg.overrides.task), hydra_cfg.job.num
        )
    return run_dir.resolve()


def _fail(message: str, code: int = 2) -> None:
    print(message, file=sys.stderr)
    raise Failed(code, message)


def execute(cfg: RecipeConfig, launched: dict | None = None) -> float | None:
    """Validate, plan and carry out `cfg.action` for one composed recipe; the final
    validation (or training) loss of a local run, None for the other actions. `launched`
    (the recipe's name and the command line's overrides) goes to RUN_DIR/overrides.yaml."""
    from launcher.plan.plan import make_plan, plan_to_dict
    from launcher.plan.render import render_plan
    from launcher.validate.short_run import fit_schedule_to_run

    for warning in fit_schedule_to_run(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.action == "suggest":
        # The search chooses the layout: only problems that no layout fixes are refused.
        from launcher.plan.suggest import report

        try:
            print(report(cfg))
        except RecipeError as err:
            _fail(f"Recipe '{cfg.name}' cannot be searched:\n{err}")
        return None
    if cfg.action == "prepare":
        _prepare(cfg)
        return None
    _validate_for_action(cfg)
    plan = make_plan(cfg)
    if cfg.action == "plan":
        if cfg.plan.format == "json":
            print(json.dumps(plan_to_dict(plan)))
        else:
            print(render_plan(plan))
        return None
    print(render_plan(plan))
    return _write_and_start(cfg, plan_to_dict(plan), launched)


def _validate_for_action(cfg: RecipeConfig) -> None:
    """Every check the action needs, before anything is written; exits on a problem."""
    from launcher.plan.memory_fit import check_fits
    from launcher.validate.data import unprepared_problems
    from launcher.validate.layout import check_runnable
    from launcher.validate.recipe import validate

    try:
        launch = cfg.action == "run"
        here = launch and cfg.cluster.backend == "local"
        validate(cfg, for_launch=launch, run_dir=cfg.action in ("run", "script"), here=here)
        if cfg.action != "plan":
            # A job that would run out of memory is refused before it is written or submitted.
            check_fits(cfg)
        if cfg.action == "run" and cfg.cluster.backend == "slurm":
            # GPU nodes never tokenize: the data is prepared first, by its own CPU job.
            problems = unprepared_problems(cfg)
            if problems:
                raise RecipeError(problems)
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    if cfg.action == "script":
        # A script may be written for a layout this trainer cannot run yet; say so loudly.
        for problem in check_runnable(cfg):
            print(f"warning: {problem}", file=sys.stderr)


def _write_and_start(cfg: RecipeConfig, plan: dict, launched: dict | None) -> float | None:
    """Claim and write the run dir, then run locally or submit (action run or script); the
    final loss of a local run."""
    from launcher.job.backends import (
        LaunchError,
        claimed_run_dir,
        never_starts,
        run_local,
        submit_slurm,
    )
    from launcher.job.failure_summary import failure_message
    from launcher.job.run_dir import JobError, check_run_dir, write_run_dir

    config_yaml = dump_config(cfg)
    try:
        check_run_dir(cfg, Path(cfg.run.dir), config_yaml)  # refuse before anything is written
        with claimed_run_dir(cfg) as lock_token:
            files = write_run_dir(cfg, Path(cfg.run.dir), config_yaml, plan, launched)
            print(f"run dir:    {files.run_dir}")
            print(f"config:     {files.config_path}")
            print(f"job script: {files.script_path}")
            if cfg.action == "script":
                return None
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
    except (JobError, LaunchError) as err:
        _fail(str(err))
    if ended.stopped_by:
        resume = "run the same command again to resume"
        print(f"stopped by {ended.stopped_by}; {resume}", file=sys.stderr)
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
    from launcher.job.backends import LaunchError
    from launcher.job.prepare import run_prepare_here, submit_prepare, write_prepare_files
    from launcher.job.run_dir import JobError
    from launcher.validate.data import prepare_problems
    from launcher.validate.recipe import validate
    from pretrain_core.problems import RecipeError
    from pretrain_core.run.run_lock import RunDirInUse, check_free

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
    print(f"config:     {files.config_path}")
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
        print(f"stopped by {stopped_by}; finished units are kept, run the same command again "
              "to resume", file=sys.stderr)  # fmt: skip
        raise Stopped(128 + signal.Signals[stopped_by].value)
    if code != 0:
        _fail(f"preparation exited with code {code}; see the output above", code)


@hydra.main(config_path=RECIPES_DIR, config_name=DEFAULT_RECIPE, version_base=None)
def _hydra_main(node: DictConfig) -> float | None:
    cfg = to_recipe(node)
    cfg.run.dir = str(_run_dir(cfg))
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    launched = {"recipe": hydra_cfg.job.config_name, "overrides": overrides}
    if hydra_cfg.mode is None or hydra_cfg.mode.name != "MULTIRUN":
        return execute(cfg, launched)
    maximize = "max" in str(getattr(hydra_cfg.sweeper, "direction", ""))
    swept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in SWEPT_KEYS]
    point = " ".join(swept or overrides)
    # One W&B group per sweep, each point named by what it changes.
    cfg.logging.wandb_name = cfg.logging.wandb_name or f"{cfg.name} {point}"[:128]
    group = f"{cfg.name}:{','.join(sorted(SWEPT_KEYS)) or 'sweep'}"
    cfg.logging.wandb_group = cfg.logging.wandb_group or group[:128]
    return run_point(hydra_cfg.job.num, point, lambda: execute(cfg, launched), maximize)


def _wants_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def _help_filter(argv: list[str]) -> str:
    """`pretrain --help cluster`: the word after --help narrows the fields listed."""
    flag = argv.index("--help") if "--help" in argv else argv.index("-h")
    rest = argv[flag + 1 : flag + 2]
    return rest[0] if rest and "=" not in rest[0] and not rest[0].startswith("-") else ""


def main() -> None:
    """Console entry point of `pretrain` (and `pretrain status`), inside the error boundary:
    a user error exits 2, Ctrl-C 130, a bug 1 with its traceback saved, never shown."""
    if sys.argv[1:2] == ["status"]:
        from launcher.job.status import main as status

        run_command("pretrain status", lambda: status(sys.argv[2:]))
    run_command("pretrain", _main)


def _main() -> None:
    """The command line and recipe files are checked before Hydra composes, and Hydra's
    errors are reported like the validator's."""
    confirmed = CONFIRM_FLAG in sys.argv[1:]  # a large sweep's go-ahead; not Hydra's flag
    try:
        argv = with_user_recipes([a for a in sys.argv[1:] if a != CONFIRM_FLAG])
        if _wants_help(argv):
            print(render_help(search_dirs(argv), _help_filter(argv)))
            return
        with sweep_scratch(argv, DEFAULT_RECIPE) as scratch:
            sys.argv[1:] = checked_command_line(argv, DEFAULT_RECIPE, confirmed) + scratch
            SWEPT_KEYS.update(swept_keys(sys.argv[1:]))
            with hydra_errors_as_problems():
                _hydra_main()
    except RecipeError as err:
        _fail(f"The command line or a recipe is not valid:\n{err}")
    if OUTCOMES:
        print(summary(OUTCOMES), file=sys.stderr)
        if not all(o.ok for o in OUTCOMES):
            raise SystemExit(1)
