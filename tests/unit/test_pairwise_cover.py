"""The pairwise matrix's cases (tests/pairwise_cases.py) hold every pair of features the
validator accepts, and each case is one a user could launch on CPU."""

from __future__ import annotations

import itertools

from tests.compat_matrix import FEATURES
from tests.pairwise_cases import (
    CASES,
    NOT_ON_CPU,
    accepted,
    covered,
    reference_of,
    required_pairs,
)


def test_every_accepted_pair_of_features_is_in_a_case() -> None:
    """A pair the validator starts accepting fails here until the cases are regenerated:
    `python -m tests.pairwise_cases --write`."""
    missing = required_pairs() - covered(CASES)
    assert not missing, f"pairs no case holds: {sorted(sorted(p) for p in missing)}"


def test_every_case_is_accepted_for_a_cpu_launch_within_its_ranks() -> None:
    refused = [case for case in CASES if not accepted(case)]
    assert not refused, f"cases validation refuses or that need too many ranks: {refused}"


def test_a_case_has_one_feature_of_each_kind() -> None:
    group = {f.name: f.group for f in FEATURES}
    for case in CASES:
        kinds = [group[name] for name in case]
        assert len(kinds) == len(set(kinds)), case


def test_what_cannot_run_on_cpu_names_features_that_exist() -> None:
    names = {f.name for f in FEATURES}
    assert all(set(entry) <= names for entry in NOT_ON_CPU)


def test_a_reference_leaves_out_every_parallel_degree() -> None:
    """The one-process run of a case computes what the case does: only numeric features."""
    for case in CASES:
        features, batch, _ = reference_of(case)
        assert batch >= 2 and not {"tp", "sp", "cp", "ep", "etp"} & set(features)
        assert all(a != b for a, b in itertools.combinations(features, 2))
