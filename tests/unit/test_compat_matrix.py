"""The compatibility matrix of docs/parallelism.md is the validator's, pair by pair."""

from __future__ import annotations

from tests.compat_matrix import FEATURES, compatibility, documented, recipe_with, render


def test_every_feature_alone_is_accepted_for_launch() -> None:
    """A feature refused on its own would make every pair with it say nothing about the pair."""
    from pretrain.launcher.validate.recipe import validate

    for feature in FEATURES:
        validate(recipe_with((feature,)), for_launch=True)


def test_the_documented_matrix_is_what_the_validator_accepts_and_refuses() -> None:
    """A rule that starts or stops refusing a pair of features fails here until the page is
    regenerated: `python -m tests.compat_matrix --write`."""
    assert documented() == render(compatibility())
