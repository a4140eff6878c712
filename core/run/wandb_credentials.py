"""Whether W&B has credentials here: asked by the trainer (auto goes online with them) and by
`pretrain-dashboard` (creating a workspace needs them); and which project a run logs to.
No wandb import."""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping


def api_key_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether W&B has credentials: WANDB_API_KEY or a netrc entry for its host."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    host = host.split("/")[0].split(":")[0]
    path = environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


DEFAULT_PROJECT = "pretrain"


def wandb_project(setting: str, environ: Mapping[str, str] = os.environ) -> str:
    """The W&B project: `logging.wandb_project` when set, else $WANDB_PROJECT (W&B's own
    convention), else DEFAULT_PROJECT."""
    return setting or environ.get("WANDB_PROJECT", "").strip() or DEFAULT_PROJECT
