"""Checkpoints resume exactly, survive a crash during a save, and reshard across layouts.

Interrupted runs are made with a crash injected while the checkpoint of step 6 is being
written (PRETRAIN_FAULT_CRASH_IN_SAVE): steps 5-6 were trained, step 6's checkpoint is left
incomplete, so the resumed run must start from step 4 and replay 5-8. Under the same layout
the FP32 losses (and gradient norms) must equal the uninterrupted run's bit for bit; under
another layout they must match within the parity tolerance.

Every run here trains through a batch-size ramp, a sequence-length warm-up and a mixture
schedule (SCHEDULES), so every resume is one in the middle of them: from step 4, with step 5
still in the ramp and the mixture's anneal ahead, under the same layout or another (one rank,
ZeRO stages, tp, and pipeline stages, whose schedule is built again at each stage).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pretrain.core.run.goodput import breakdown
from pretrain.core.run.ledger import read_ledger
from pretrain.core.run.rundir import LEDGER_FILE
from pretrain.trainer.checkpoint.export import export, load_model
from pretrain.trainer.step.state import lm_loss
from tests.distributed.harness import BASE_OVERRIDES, FP32_TOLERANCE, read_curve
from tests.golden.cases import CORPUS

pytestmark = pytest.mark.distributed

STEPS = 8
CRASH_STEP = 6
CHECKPOINTING = ["checkpoint.every=2", "checkpoint.keep=3"]
SCHEDULES = [
    # Steps 1-2 of 4 sequences of 32 tokens, 3-5 of 4 x 64, then the harness's 8 x 64.
    "train.batch_schedule=[{global_batch:4,until_tokens:1024}]",
    "train.seq_len_schedule=[{seq_len:32,until_tokens:256}]",
    # Two sources (the harness's and the golden curves' corpus), drawn by a's alone at
    # first, blending into half and half by 512 tokens, then by b's alone from 1,536.
    f"data.sources=[{{source:stdlib,name:a,max_bytes:400000}},{{source:{CORPUS},name:b}}]",
    "data.mixture_schedule=[{weights:[1,0],blend:true},{from_tokens:512,weights:[1,1]},"
    "{name:anneal,from_tokens:1536,weights:[0,1]}]",
]
TOKENS = [128, 256, 512, 768, 1024, 1536, 2048, 2560]
"""Tokens trained through each step."""
TOKENS_SEEN = {
    "a": [128, 256, 448, 576, 704, 960, 960, 960],
    "b": [0, 0, 64, 192, 320, 576, 1088, 1600],
}
"""Tokens each source supplied through each step, by hand: a step of U sequences of 64
tokens (the data order's; 2 a step of 4 x 32) draws by the shares at its first token, and
source b's j-th sequence falls due where its running share reaches j + 1/2. b's share is 0,
1/8 (at 128 tokens), 1/4 (256: 0.25 + 4 x 1/4 = 1.25 due, 1 drawn), 1/2 from 512 (3.25, 5.25,
9.25) and 1 from 1,536 (17.25, 25.25)."""


def launch(
    run_dir: Path, overrides: list[str], nproc: int, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The pretrain CLI on `nproc` CPU ranks; the result, whether it failed or not."""
    cmd = [
        sys.executable,
        "-m",
        "pretrain",
        "--config-name",
        "tiny",
        *BASE_OVERRIDES,
        *CHECKPOINTING,
        *SCHEDULES,
        f"cluster.gpus_per_node={nproc}",
        f"run.dir={run_dir}",
        *overrides,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full_env)
    (run_dir.parent / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    return result


def train(run_dir: Path, overrides: list[str], nproc: int) -> dict[int, float]:
    result = launch(run_dir, overrides, nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(run_dir)


def crash_during_save(run_dir: Path, overrides: list[str], nproc: int) -> None:
    result = launch(run_dir, overrides, nproc, {"PRETRAIN_FAULT_CRASH_IN_SAVE": str(CRASH_STEP)})
    assert result.returncode != 0
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004", f"step_{CRASH_STEP:08d}.tmp"]


def rows(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics from metrics.jsonl; a step logged again after a resume counts last."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl; a step logged again after a resume counts last."""
    return {step: row["loss"] for step, row in rows(run_dir).items()}


def max_relative(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys() == set(range(1, STEPS + 1))
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.fixture(scope="module")
def uninterrupted(workdir: Path) -> dict[int, float]:
    return train(workdir / "uninterrupted", ["parallel.zero=3"], nproc=2)


@pytest.fixture(scope="module")
def crashed_zero3(workdir: Path) -> Path:
    run_dir = workdir / "crashed_zero3"
    crash_during_save(run_dir, ["parallel.zero=3"], nproc=2)
    return run_dir


def test_resume_after_a_crash_during_a_save_is_bit_exact(
    workdir, uninterrupted, crashed_zero3
) -> None:
    resumed = workdir / "resumed_zero3"
    shutil.copytree(crashed_zero3, resumed)
    after = train(resumed, ["parallel.zero=3"], nproc=2)
    log = (workdir / "resumed_zero3.log").read_text()
    assert "resumed from the checkpoint of step 4" in log
    # The load's progress line: the step, its size on disk, where, and how long it took.
    loaded = r"checkpoint: loaded step 4 \([\d.]+[kM]?B\) from \S+/step_00000004 in \d+\.\ds"
    assert re.search(loaded, log), log[-3000:]
    assert after == uninterrupted
    metrics = [resumed / "metrics.jsonl", workdir / "uninterrupted" / "metrics.jsonl"]
    assert read_curve(metrics[0]).grad_norm == read_curve(metrics[1]).grad_norm
    # The ramp, the LR by tokens and the mixture resume where they were, bit for bit.
    again, first = rows(resumed), rows(workdir / "uninterrupted")
    same = ("lr", "tokens", "global_batch", "seq_len", "tokens_seen_a", "tokens_seen_b")
    same += ("val_loss", "val_loss_a", "val_loss_b")
    assert [[again[k].get(m) for m in same] for k in again] == [
        [first[k].get(m) for m in same] for k in again
    ]
    assert [first[k]["tokens"] for k in range(1, STEPS + 1)] == TOKENS
    assert [(first[k]["global_batch"], first[k]["seq_len"]) for k in (1, 3, 6)] == [
        (4, 32), (4, 64), (8, 64),
    ]  # fmt: skip
    for source, seen in TOKENS_SEEN.items():
        assert [first[k][f"tokens_seen_{source}"] for k in range(1, STEPS + 1)] == seen
    # Each source's validation loss, on its own held-out documents.
    for step in (4, 8):
        assert first[step]["val_loss_a"] != first[step]["val_loss_b"]
    complete = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert complete == ["step_00000004", "step_00000006", "step_00000008"]


def test_zero3_dp2_checkpoint_resumes_on_one_rank(workdir, uninterrupted, crashed_zero3) -> None:
    resumed = workdir / "zero3_to_dp1"
    shutil.copytree(crashed_zero3, resumed)
    after = train(resumed, ["parallel.zero=3"], nproc=1)
    assert max_relative(after, uninterrupted) <= FP32_TOLERANCE
    assert (resumed / "config.1.yaml").exists()  # the config it was first trained under
    assert (resumed / "plan.1.json").exists()  # and its plan
    # The ledger keeps the crashed run's records as they were and appends the resume's.
    assert (resumed / LEDGER_FILE).read_text().startswith((crashed_zero3 / LEDGER_FILE).read_text())
    records, skipped = read_ledger(resumed) or ([], -1)
    assert skipped == 0 and [r["kind"] for r in records] == ["launch", "job", "launch", "job"]
    jobs = [(r["world_size"], r["start_step"]) for r in records if r["kind"] == "job"]
    assert jobs == [(2, 0), (1, 4)]


@pytest.mark.parametrize(
    ("label", "saved_under", "resumed_under"),
    [
        ("ddp_to_zero3", ["parallel.zero=0"], ["parallel.zero=3"]),
        (
            "zero1_to_zero3_async",
            ["parallel.zero=1"],
            ["parallel.zero=3", "checkpoint.async_mode=thread"],
        ),
    ],
)
def test_checkpoint_resumes_under_another_data_parallel_layout(
    workdir, uninterrupted, label, saved_under, resumed_under
) -> None:
    run_dir = workdir / label
    crash_during_save(run_dir, saved_under, nproc=2)
    after = train(run_dir, resumed_under, nproc=2)
    assert max_relative(after, uninterrupted) <= FP32_TOLERANCE


def test_zero3_checkpoint_loads_into_zero1_owned_tensor_parallel_shares(
    workdir, uninterrupted, crashed_zero3
) -> None:
    """Each ZeRO-1 owner (of 2 dp ranks) loads its parameters' states, split over tp=2."""
    resumed = workdir / "zero3_to_zero1_tp2"
    shutil.copytree(crashed_zero3, resumed)
    after = train(resumed, ["parallel.zero=1", "parallel.tp=2"], nproc=4)
    assert max_relative(after, uninterrupted) <= FP32_TOLERANCE


def test_consecutive_nan_steps_stop_the_run_without_saving_them(workdir) -> None:
    run_dir = workdir / "nan_twice"
    env = {"PRETRAIN_FAULT_NAN_STEPS": "3,4"}
    result = launch(run_dir, ["parallel.zero=3", "faults.max_bad_steps=2"], 2, env)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    summary = result.stderr.splitlines()[-4]
    assert summary.startswith("training failed on rank ") and " of 2 (host " in summary
    assert "step 4: 2 consecutive steps with a non-finite loss" in summary
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_killed_rank_restarts_a_stopped_run_resumes_and_every_second_is_accounted(
    workdir, uninterrupted
) -> None:
    """One run, three attempts: rank 1 dies after step 6 (step 6's checkpoint not yet
    written), torchrun restarts the group from step 4, which is stopped as step 7 begins
    (SIGUSR1, as SLURM sends before the time limit) and saves; a second job finishes it."""
    run_dir = workdir / "killed_rank"
    overrides = ["parallel.zero=3", "cluster.max_restarts=1"]
    began = time.time()
    env = {"PRETRAIN_FAULT_KILL": "1:6", "PRETRAIN_FAULT_STOP": "7"}
    result = launch(run_dir, overrides, 2, env)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "rank 1 kills itself after step 6" in output
    assert "resumed from the checkpoint of step 4" in output
    assert "stopped by SIGUSR1 after step 7; saved" in output
    # The forked rank's death is one line in the agent's log, as a fresh rank's would be:
    # no traceback of torchrun's own join.
    agent_log = (run_dir / "logs" / "torchrun.log").read_text()
    assert "failed (exitcode: -9) local_rank: 1" in agent_log
    assert "Traceback" not in agent_log
    finished = launch(run_dir, overrides, 2)
    wall = time.time() - began
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resumed from the checkpoint of step 7" in finished.stdout
    assert losses(run_dir) == uninterrupted

    events = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    account = breakdown(events)
    assert account.attempts == 3
    # Built by hand from the events: step 5 of the first attempt was trained again after the
    # restart from step 4 (its step 6 died unlogged, with the failure); every other logged
    # step counts once.
    first_attempt = events[: [e["event"] for e in events].index("attempt", 1)]
    redone = sum(e["s"] for e in first_attempt if e["event"] == "steps" and e["last"] > 4)
    steps = sum(e["s"] for e in events if e["event"] == "steps")
    assert redone > 0 and account.recomputed_s == pytest.approx(redone)
    assert account.productive_s == pytest.approx(steps - redone)
    assert account.goodput == account.productive_s / account.total_s
    for term in ("checkpoint_save_s", "checkpoint_load_s", "startup_s", "evaluation_s",
                 "failures_s", "between_jobs_s", "shutdown_s"):  # fmt: skip
        assert account.terms[term] > 0, (term, account)
    assert account.queue_s == 0 and not account.queue_notes  # not a SLURM job
    # The terms add up to the wall time the test measured around both jobs.
    assert abs(sum(account.terms.values()) - wall) <= 0.02 * wall, (wall, account)
    assert abs(account.total_s - wall) <= 0.02 * wall, (wall, account)
    (workdir / "killed_rank.goodput.txt").write_text(f"{account.line()}\nwall {wall:.2f} s\n")
    summary = next(line for line in finished.stdout.splitlines() if "goodput " in line)
    assert summary.strip().startswith("goodput ") and "over 3 attempts: productive " in summary
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < last["goodput"] < 1
    assert last["goodput_recomputed_s"] == pytest.approx(redone, abs=1e-3)


TIMEOUT_FACTOR = 3
TIMEOUT_FLOOR_S = 5.0
CONSTANT_TIMEOUT_S = 120.0


def test_a_hung_rank_is_named_at_the_timeout_its_measured_steps_set(workdir) -> None:
    run_dir = workdir / "hung_rank"
    overrides = [
        "parallel.zero=3",
        f"faults.collective_timeout_s={CONSTANT_TIMEOUT_S}",
        f"faults.timeout_factor={TIMEOUT_FACTOR}",
        f"faults.timeout_floor_s={TIMEOUT_FLOOR_S}",
    ]
    result = launch(run_dir, overrides, 2, {"PRETRAIN_FAULT_HANG": "1:3"})
    assert result.returncode != 0
    assert "rank 1 hangs after step 3" in result.stdout
    # Until a step was measured the constant holds (the plan predicts no CPU step time);
    # step 2, the first after the warm-up step, sets the limit the hang meets.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["timeout_step_s"] == CONSTANT_TIMEOUT_S
    assert rows[0]["timeout_save_s"] == CONSTANT_TIMEOUT_S
    assert [row["step"] for row in rows if "timeout_step_longest_s" in row] == [2]
    longest = rows[1]["timeout_step_longest_s"]
    limit = rows[1]["timeout_step_s"]
    # The step's phase of the loop lies within the window the metrics row timed.
    assert 0 < longest <= rows[1]["step_time_s"]
    assert limit == max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * longest) < CONSTANT_TIMEOUT_S
    assert f"timeouts: step {limit:.3g} s ({TIMEOUT_FACTOR} x the longest step" in result.stdout
    # Rank 0 timed out waiting for the hung rank: a summary here, the traceback in its log.
    assert "Traceback" not in result.stderr
    summary = result.stderr.strip().splitlines()[-3:]
    assert summary[0].startswith("training failed on rank 0 of 2 (host ")
    assert "a collective timed out" in summary[0]
    waited = re.search(r"Timed out waiting (\d+)ms", summary[0])
    assert waited and abs(int(waited[1]) - limit * 1000) <= 1, summary[0]
    assert "faults.collective_timeout_s" in summary[1]
    log = (run_dir / "logs" / "rank_0.log").read_text()
    # Rank 0 waits in step 3's metrics (the loss all-reduce); rank 1 hung after its step 3.
    # The log's header of the failure, then its traceback: the error's own line is last.
    error = [line for line in log.splitlines() if "CollectiveTimeout: " in line][-1]
    waiting = re.search(r"ranks \[0\] entered collective #(\d+) \((\S+)\)", error)
    stuck = re.search(r"ranks \[1\] never arrived: rank 1 \(host \S+\) last entered #(\d+)", error)
    assert "rank 0 (host " in error and "step 3 (metrics)" in error
    assert waiting and stuck and int(stuck[1]) == int(waiting[1]) - 1, error
    assert "at step 3 (training; no progress for" in error
    records = {p.name: json.loads(p.read_text()) for p in (run_dir / "hangs").iterdir()}
    assert sorted(records) == ["rank_0.json", "rank_1.json"]
    assert records["rank_1.json"]["step"] == 3
    # The hung rank's own watchdog named it at its measured limit, not the constant.
    stalled = re.fullmatch(r"no progress for (\d+) s", records["rank_1.json"]["reason"])
    assert stalled and int(stalled[1]) <= TIMEOUT_FACTOR * longest + TIMEOUT_FLOOR_S + 1


# Model parallelism fills the 2-rank world (dp 1; TP with DP replicas needs ZeRO >= 2).
MODEL_PARALLEL = {
    "tp2": ["parallel.zero=3", "parallel.tp=2"],
    "pp2": ["parallel.zero=3", "parallel.pp=2"],
}
PADDED_VOCAB = "model.vocab_size=511"  # tp=2 pads it to 512 rows


@pytest.fixture(scope="module")
def crashed_pp2(workdir: Path) -> Path:
    """A run dir interrupted under pp=2: complete checkpoints 2 and 4. (A tp=2 checkpoint
    resumes under dp=2 in `test_vocab_rows_padded_under_tp_are_dropped_without_it`.)"""
    run_dir = workdir / "crashed_pp2"
    crash_during_save(run_dir, MODEL_PARALLEL["pp2"], nproc=2)
    return run_dir


@pytest.fixture(scope="module")
def padded_uninterrupted(workdir: Path) -> dict[int, float]:
    return train(workdir / "padded_uninterrupted", [PADDED_VOCAB, "parallel.zero=3"], nproc=2)


@pytest.fixture(scope="module")
def crashed_tp2_padded(workdir: Path) -> Path:
    run_dir = workdir / "crashed_tp2_padded"
    crash_during_save(run_dir, [PADDED_VOCAB, *MODEL_PARALLEL["tp2"]], nproc=2)
    return run_dir


def test_pipeline_checkpoint_resumes_under_data_parallelism(
    workdir, uninterrupted, crashed_pp2
) -> None:
    resumed = workdir / "pp2_to_dp2"
    shutil.copytree(crashed_pp2, resumed)
    after = train(resumed, ["parallel.zero=3"], nproc=2)
    assert "resumed from the checkpoint of step 4" in (workdir / f"{resumed.name}.log").read_text()
    assert max_relative(after, uninterrupted) <= FP32_TOLERANCE


def test_dp2_checkpoint_resumes_into_pipeline_stages(workdir, uninterrupted, crashed_zero3) -> None:
    resumed = workdir / "dp2_to_pp2"
    shutil.copytree(crashed_zero3, resumed)
    after = train(resumed, MODEL_PARALLEL["pp2"], nproc=2)
    assert max_relative(after, uninterrupted) <= FP32_TOLERANCE


def test_vocab_rows_padded_under_tp_are_dropped_without_it(
    workdir, padded_uninterrupted, crashed_tp2_padded
) -> None:
    """A tp=2 checkpoint (its vocabulary padded to 512 rows) resumes under dp=2."""
    resumed = workdir / "tp2_padded_to_dp2"
    shutil.copytree(crashed_tp2_padded, resumed)
    after = train(resumed, [PADDED_VOCAB, "parallel.zero=3"], nproc=2)
    assert "resumed from the checkpoint of step 4" in (workdir / f"{resumed.name}.log").read_text()
    assert max_relative(after, padded_uninterrupted) <= FP32_TOLERANCE


def test_vocab_rows_are_padded_when_resuming_under_tp(workdir, padded_uninterrupted) -> None:
    resumed = workdir / "dp2_to_tp2_padded"
    shutil.copytree(workdir / "padded_uninterrupted", resumed)
    for step in (6, 8):  # leave step 4 the newest: the resumed run retrains 5-8
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    after = train(resumed, [PADDED_VOCAB, *MODEL_PARALLEL["tp2"]], nproc=2)
    assert "resumed from the checkpoint of step 4" in (workdir / f"{resumed.name}.log").read_text()
    assert max_relative(after, padded_uninterrupted) <= FP32_TOLERANCE


def assert_same_loss(actual: nn.Module, expected: nn.Module, vocab_size: int) -> None:
    """Two plain models, trained to the same step under two layouts, give the same loss on
    a batch within the parity tolerance (element-wise, Adam's normalized updates can move a
    weight whose gradient is at rounding noise further than the tolerance)."""
    assert actual.state_dict().keys() == expected.state_dict().keys()
    tokens = torch.randint(vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (lm_loss(m(tokens[:, :-1]), tokens[:, 1:]) for m in (actual, expected))
    assert abs(ours - theirs) / theirs <= FP32_TOLERANCE


def test_pipeline_checkpoint_loads_into_the_plain_model(
    workdir, uninterrupted, crashed_pp2
) -> None:
    """(A tp=2 checkpoint's: `test_export_of_a_tp_checkpoint_drops_the_padded_vocab_rows`.)"""
    ours, _, _ = load_model(crashed_pp2, step=4)
    reference, cfg, _ = load_model(workdir / "uninterrupted", step=4)
    assert_same_loss(ours, reference, cfg.model.vocab_size)


def test_export_of_a_tp_checkpoint_drops_the_padded_vocab_rows(
    workdir, padded_uninterrupted, crashed_tp2_padded, tmp_path
) -> None:
    out = export(crashed_tp2_padded, tmp_path / "hf", step=4)
    reference, cfg, _ = load_model(workdir / "padded_uninterrupted", step=4)
    weights = load_file(out / "model.safetensors")
    vocab_rows = (cfg.model.vocab_size, cfg.model.dim)
    assert weights["model.embed_tokens.weight"].shape == vocab_rows
    assert weights["lm_head.weight"].shape == vocab_rows
    assert json.loads((out / "config.json").read_text())["vocab_size"] == cfg.model.vocab_size
    ours, _, _ = load_model(crashed_tp2_padded, step=4)
    assert_same_loss(ours, reference, cfg.model.vocab_size)
