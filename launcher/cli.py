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
import re
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.compose import SHIPPED_RECIPES, checked_command_line, hydra_errors_as_problems
from pretrain_core.problems import RecipeError
from pretrain_core.schema import RecipeConfig, dump_config, to_recipe

RECIPES_DIR = str(SHIPPED_RECIPES)
DEFAULT_RECIPE = "tiny"

ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)


def _run_dir(cfg: RecipeConfig) -> Path:
    """The run dir: `run.dir`, else runs/<name>, plus the override string in a sweep."""
    if cfg.run.dir:
        return Path(cfg.run.dir).expanduser().resolve()
    run_dir = Path("runs") / cfg.name
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        point = hydra_cfg.job.override_dirname or f"point{hydra_cfg.job.num}"
        run_dir = run_dir / re.sub(r"[^A-Za-z0-9_.=,-]+", "_", point)
    return run_dir.resolve()


def _fail(message: str, code: int = 2) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(code)


def execute(cfg: RecipeConfig) -> None:
    """Validate, plan and carry out `cfg.action` for one composed recipe."""
    from launcher.plan import make_plan, plan_to_dict
    from launcher.render import render_plan
    from launcher.short_run import fit_schedule_to_run

    for warning in fit_schedule_to_run(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.action == "suggest":
        # The search chooses the layout: only problems that no layout fixes are refused.
        from launcher.suggest import report

        try:
            print(report(cfg))
        except RecipeError as err:
            _fail(f"Recipe '{cfg.name}' cannot be searched:\n{err}")
        return
    if cfg.action == "prepare":
        _prepare(cfg)
        return
    _validate_for_action(cfg)
    plan = make_plan(cfg)
    if cfg.action == "plan":
        if cfg.plan.format == "json":
            print(json.dumps(plan_to_dict(plan)))
        else:
            print(render_plan(plan))
        return
    print(render_plan(plan))
    _write_and_start(cfg, plan_to_dict(plan))


def _validate_for_action(cfg: RecipeConfig) -> None:
    """Every check the action needs, before anything is written; exits on a problem."""
    from launcher.memory_fit import check_fits
    from launcher.rules_data import unprepared_problems
    from launcher.rules_parallel import check_runnable
    from launcher.validate import validate

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


def _write_and_start(cfg: RecipeConfig, plan: dict) -> None:
    """Claim and write the run dir, then run locally or submit (action run or script)."""
    from launcher.backends import (
        LaunchError,
        claimed_run_dir,
        never_starts,
        run_local,
        submit_slurm,
    )
    from launcher.failure_summary import failure_message
    from launcher.job import JobError, check_run_dir, write_run_dir

    config_yaml = dump_config(cfg)
    try:
        check_run_dir(cfg, Path(cfg.run.dir), config_yaml)  # refuse before anything is written
        with claimed_run_dir(cfg) as lock_token:
            files = write_run_dir(cfg, Path(cfg.run.dir), config_yaml, plan)
            print(f"run dir:    {files.run_dir}")
            print(f"config:     {files.config_path}")
            print(f"job script: {files.script_path}")
            if cfg.action == "script":
                return
            if cfg.cluster.backend == "slurm":
                job = submit_slurm(files)
                print(f"submitted SLURM job {job.job_id}; log: {job.log_path}")
                # The controller judges a job when it is submitted: one it can never start
                # is said so now, not found pending days later (if it can be asked).
                with contextlib.suppress(LaunchError):
                    cannot_start = never_starts(job.job_id)
                    if cannot_start:
                        _fail(cannot_start)
                return
            ended = run_local(files, cfg, lock_token)
    except (JobError, LaunchError) as err:
        _fail(str(err))
    if ended.stopped_by:
        _fail(f"stopped by {ended.stopped_by}; run the same command again to resume", ended.code)
    if ended.code != 0:
        _fail(failure_message(files.run_dir, ended.code), ended.code)


def _prepare(cfg: RecipeConfig) -> None:
    """Validate the data fields (and, locally, the files), then prepare or submit."""
    from launcher.backends import LaunchError
    from launcher.job import JobError
    from launcher.prepare_job import run_prepare_here, submit_prepare, write_prepare_files
    from launcher.rules_data import prepare_problems
    from launcher.validate import validate
    from pretrain_core.problems import RecipeError

    try:
        validate(cfg)
        problems = prepare_problems(cfg)
        if problems:
            raise RecipeError(problems)
        files = write_prepare_files(cfg, Path(cfg.run.dir))
    except RecipeError as err:
        _fail(f"Recipe '{cfg.name}' is not valid:\n{err}")
    except JobError as err:
        _fail(str(err))
    print(f"config:     {files.config_path}")
    if cfg.cluster.backend == "slurm":
        try:
            job = submit_prepare(files)
        except LaunchError as err:
            _fail(str(err))
        print(f"submitted SLURM job {job.job_id} (prepare); log: {job.log_path}")
        return
    code = run_prepare_here(files)
    if code != 0:
        _fail(f"preparation exited with code {code}; see the output above", code)


@hydra.main(config_path=RECIPES_DIR, config_name=DEFAULT_RECIPE, version_base=None)
def _hydra_main(node: DictConfig) -> None:
    cfg = to_recipe(node)
    cfg.run.dir = str(_run_dir(cfg))
    execute(cfg)


def main() -> None:
    """Console entry point of `pretrain`: the command line and recipe files are checked
    before Hydra composes, and Hydra's errors are reported like the validator's."""
    try:
        sys.argv[1:] = checked_command_line(sys.argv[1:], DEFAULT_RECIPE)
        with hydra_errors_as_problems():
            _hydra_main()
    except RecipeError as err:
        _fail(f"The command line or a recipe is not valid:\n{err}")
