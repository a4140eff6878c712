"""`python -m trainer.dryrun RANK < config.yaml`: dry-run rank RANK of the resolved recipe
read from stdin (nothing is read from or written to disk) and print one JSON object; a
layout that fails to build or step prints {"rank", "error"} and exits 1."""

import json
import sys

from pretrain_core.schema import to_recipe

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.dryrun RANK < config.yaml")
    from omegaconf import OmegaConf

    from trainer.dryrun.run import dry_run

    rank = int(sys.argv[1])
    cfg = to_recipe(OmegaConf.create(sys.stdin.read()))
    try:
        result = dry_run(cfg, rank)
    except Exception as error:  # the report names what broke, for the launcher to print
        print(json.dumps({"rank": rank, "error": f"{type(error).__name__}: {error}"}))
        sys.exit(1)
    print(json.dumps(result))
