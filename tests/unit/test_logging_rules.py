"""The logging fields' rules: W&B's limits on names, job types and tags."""

from __future__ import annotations

from tests.helpers import configure, problems


def test_wandb_names_job_types_and_tags_beyond_wandbs_limits_are_refused() -> None:
    cfg = configure({
        "logging.wandb_group": "g" * 129,
        "logging.wandb_job_type": "",
        "logging.wandb_tags": ["ok", "t" * 65, "two\nlines"],
    })  # fmt: skip
    assert [(p.field, p.fix) for p in problems(cfg)] == [
        ("logging.wandb_group", "shorten it and drop line breaks"),
        ("logging.wandb_job_type", "use train (the default)"),
        ("logging.wandb_tags[1]", "shorten it, or remove it"),
        ("logging.wandb_tags[2]", "shorten it, or remove it"),
    ]
