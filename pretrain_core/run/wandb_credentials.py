"""Whether W&B has credentials here: asked by the trainer (auto goes online with them) and by
`pretrain-dashboard` (creating a workspace needs them); no wandb import."""

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
