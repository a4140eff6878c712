"""`python -m pretrain.trainer.dryrun RANK < config.yaml`: dry-run rank RANK of the resolved recipe
read from stdin (nothing is read from or written to disk) and print one JSON object; a
layout that fails to build or step prints {"rank", "error"} and exits 1."""

import json
import sys

from pretrain.core.schema import to_recipe

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pretrain.trainer.dryrun RANK < config.yaml")
    from omegaconf import OmegaConf

    from pretrain.trainer.dryrun.run import DryRunFailure, dry_run

    rank = int(sys.argv[1])
    cfg = to_recipe(OmegaConf.create(sys.stdin.read()))
    try:
        result = dry_run(cfg, rank)
    except DryRunFailure as error:
        print(json.dumps({"rank": rank, "error": str(error)}))
        sys.exit(1)
    except ValueError as error:  # a layout or rank the dry run cannot take
        print(json.dumps({"rank": rank, "error": str(error)}))
        sys.exit(1)
    print(json.dumps(result))
