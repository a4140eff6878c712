"""The default install runs the default recipe; a feature whose package is an extra that is
not installed is refused before any job starts, with the extra to install, or (W&B under
logging.wandb=auto) turned off with a line that says so. A package is made missing here
as Python itself reports one: a None entry in sys.modules blocks its import."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from pretrain.core.problems import RecipeError, install_fix, installed
from pretrain.launcher.validate.recipe import validate
from pretrain.trainer.observe.loggers import resolve_wandb_mode
from tests.helpers import configure


def missing(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def problems(overrides: dict) -> dict[str, str]:
    cfg = configure({"cluster.backend": "local", **overrides})
    try:
        validate(cfg, for_launch=True)
    except RecipeError as err:
        return {p.field: str(p) for p in err.problems}
    return {}


def test_installed_looks_a_package_up_without_importing_it(monkeypatch) -> None:
    assert installed("json") and not installed("no_such_package_here")
    missing(monkeypatch, "json")
    assert not installed("json")
    assert install_fix("datasets") == "pip install 'pretrain[hf]'"
    assert install_fix("something") == "pip install something"


def test_without_wandb_auto_turns_it_off_and_an_explicit_mode_is_refused(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    missing(monkeypatch, "wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode("auto") == "disabled"
    assert resolve_wandb_mode("offline") == "offline"  # the launcher refuses it first:
    found = problems({"logging.wandb": "offline"})
    assert found["logging.wandb"] == (
        "logging.wandb=offline: the wandb package is not installed; pip install "
        "'pretrain[wandb]', or logging.wandb=auto (off where wandb is missing) or disabled"
    )
    assert "logging.wandb" not in problems({"logging.wandb": "auto"})
    from tests.unit.test_loggers import make_logger

    with make_logger(tmp_path, wandb="auto"):
        pass
    assert "W&B off: the wandb package is not installed (pip install 'pretrain[wandb]')" in (
        capsys.readouterr().out
    )


def test_sources_read_by_an_extras_package_are_refused_without_it(
    monkeypatch, tmp_path: Path
) -> None:
    parquet = tmp_path / "data" / "a.parquet"
    parquet.parent.mkdir()
    parquet.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    missing(monkeypatch, "datasets", "pyarrow")
    hub = problems({"data.source": "hf:HuggingFaceFW/fineweb"})["data.source"]
    assert "reading a hub dataset needs the datasets package; pip install 'pretrain[hf]'" in hub
    files = problems({"data.source": str(parquet.parent)})["data.source"]
    assert "reading Parquet files needs the pyarrow package; pip install 'pretrain[hf]'" in files


def test_the_default_install_declares_no_optional_package() -> None:
    import tomllib

    from tests.helpers import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {importlib.util.resolve_name(d.split(">")[0].split("[")[0], None)
             for d in project["dependencies"]}  # fmt: skip
    assert not names & {"wandb", "datasets", "tensorboard", "torchao", "wandb-workspaces"}
    extras = project["optional-dependencies"]
    assert {"wandb", "hf", "tensorboard", "fp8", "dev"} <= set(extras)
