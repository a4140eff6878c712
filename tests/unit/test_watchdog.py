"""How a hang is explained from the ranks' records: the members of a group behind the
furthest collective issued on it never arrived."""

from __future__ import annotations

from pretrain.trainer.faults.watchdog import missing_ranks


def record(rank: int, step: int, world: int, dp: int | None = None, reason: str = "") -> dict:
    groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3], "entered": world,
                    "operation": f"gloo:all_reduce #{world}"}}  # fmt: skip
    if dp is not None:
        dp_ranks = [0, 1] if rank < 2 else [2, 3]
        groups[f"dp{dp_ranks[0]}"] = {
            "desc": "mesh_dp", "ranks": dp_ranks, "entered": dp, "operation": None,
        }  # fmt: skip
    return {"rank": rank, "host": f"node{1 + rank // 2}", "step": step, "phase": "training",
            "reason": reason or "no progress for 5 s", "groups": groups}  # fmt: skip


def test_the_ranks_behind_the_furthest_collective_are_named_with_where_they_stopped() -> None:
    records = {r: record(r, step=4, world=12, dp=30) for r in (0, 1, 3)}
    records[2] = record(2, step=3, world=11, dp=29)
    text = missing_ranks(records)
    assert text.startswith(
        "on group default_pg (ranks [0, 1, 2, 3]) ranks [0, 1, 3] entered collective #12 "
        "(gloo:all_reduce #12) and ranks [2] never arrived: rank 2 (host node2) last entered "
        "#11 (gloo:all_reduce #11) at step 3 (training; no progress for 5 s)"
    )
    # Its data-parallel group tells the same; the other pair's group is in step.
    assert "on group mesh_dp (ranks [2, 3]) ranks [3] entered collective #30" in text
    assert "ranks [0, 1]) ranks" not in text


def test_a_rank_without_a_record_is_named_as_possibly_dead() -> None:
    records = {r: record(r, step=4, world=12) for r in (0, 1, 2)}
    assert "rank 3 left no record (its process may have died)" in missing_ranks(records)


def test_ranks_in_step_everywhere_name_no_one() -> None:
    records = {r: record(r, step=4, world=12, dp=30) for r in range(4)}
    assert missing_ranks(records) == "every rank that left a record reached the same collectives"
