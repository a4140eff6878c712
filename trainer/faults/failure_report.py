"""One way a rank fails: a record of the cause and its fix, the traceback in the run dir.

Every exception that ends a rank is classified (data unreachable or unreadable, disk full,
no usable checkpoint, out of memory, a collective that timed out or lost its peer, too
many non-finite steps, the run dir held by another trainer, or an unexpected error) into
one line of cause and one of fix. The rank appends the full traceback to
RUN_DIR/logs/rank_R.log, writes RUN_DIR/logs/failure_rank_R.json (which the launcher
turns into its summary), prints one line to stderr and exits with code 1.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain.core.hardware import GIB
from pretrain.core.inputs.reading import ReadError, number, read_mapping
from pretrain.core.run.run_lock import RunDirInUse
from pretrain.core.run.rundir import LOGS_DIR, PLAN_FILE, failure_record, rank_log
from pretrain.trainer.checkpoint.integrity import DiskSpaceError, NoUsableCheckpoint
from pretrain.trainer.faults.step_guard import TooManyBadSteps

DATA_MODULES = (
    "trainer/data/loader.py",
    "dataprep/corpus.py",
    "dataprep/tokenizer.py",
    "trainer/data/prefetch.py",
    "/datasets/",
    "/huggingface_hub/",
    "/tokenizers/",
    "/pyarrow/",
)
"""Where a data failure is raised from (the frames of the traceback)."""
MAX_CAUSE = 400


@dataclass(frozen=True)
class Failure:
    """What ended a rank, in two lines a user can act on."""

    kind: str
    """data, disk, checkpoint, oom, timeout, peer, nan, lock, stopped or error."""
    cause: str
    fix: str


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _text(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 3] + "..."


def _raised_in(exc: BaseException, places: tuple[str, ...]) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return any(place in frame.filename for frame in frames for place in places)


def _is_disk_full(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or (
        "No space left on device" in text or "unexpected pos" in text
    )


def _memory_line(run_dir: Path) -> str:
    """Measured peak memory of this rank beside the plan's prediction (plan.json)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        peak = torch.cuda.max_memory_allocated(device) / GIB
        measured = f"peak {peak:.2f} GiB allocated of the device's {total:.2f} GiB"
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        measured = f"peak {rss:.2f} GiB resident"
    try:
        plan = read_mapping(run_dir / PLAN_FILE, "the run's plan.json")
    except ReadError:
        plan = {}
    predicted = number(plan.get("memory_gib"))
    if predicted is None:
        return f"{measured}; no plan.json to compare with"
    return f"{measured}; the plan predicted {predicted:.2f} GiB per rank"


def classify(exc: BaseException, run_dir: Path) -> Failure:
    """The kind, cause and fix of the exception that ended this rank."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, RunDirInUse):
            return Failure("lock", str(e), "wait for the other trainer, or pick another run.dir")
        if isinstance(e, DiskSpaceError) or _is_disk_full(e):
            fix = "free space there, lower checkpoint.keep, or move run.dir"
            return Failure("disk", f"disk full: {_text(e)}", fix)
        if isinstance(e, NoUsableCheckpoint):
            return Failure("checkpoint", str(e), e.fix)
        if isinstance(e, TooManyBadSteps):
            return Failure("nan", str(e), "resume with a lower optim.lr or longer warmup")
        if "out of memory" in str(e).lower() or "can't allocate memory" in str(e):
            cause = f"out of memory ({_memory_line(run_dir)}): {_text(e)}"
            fix = (
                "lower train.micro_batch, set recompute=selective or full, or shard more "
                "(parallel.zero=3, a larger parallel.tp or pp)"
            )
            return Failure("oom", cause, fix)
    if _raised_in(exc, DATA_MODULES):
        return _data_failure(exc)
    text = " ".join(str(e) for e in chain)
    if "timed out" in text.lower() or "timeout" in text.lower():
        fix = (
            "another rank stopped responding (see its log); if a phase legitimately takes "
            "longer, raise faults.timeout_factor or faults.timeout_floor_s (after the first "
            "steps) or faults.collective_timeout_s (start-up, first save and evaluation)"
        )
        return Failure("timeout", f"a collective timed out: {_text(exc)}", fix)
    peer_lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    if any(marker in text for marker in peer_lost):
        cause = f"lost the connection to another rank: {_text(exc)}"
        return Failure("peer", cause, "another rank failed first: see its failure")
    return Failure("error", _text(exc), "unexpected: see the traceback, and report it")


def _data_failure(exc: BaseException) -> Failure:
    chain = _chain(exc)
    names = " ".join(type(e).__name__ for e in chain)
    network = ("Connection", "Offline", "HTTP", "Timeout", "EntryNotFound")
    if any(word in names for word in network):
        fix = (
            "check the network (or HF_ENDPOINT); or prepare the data where there is network "
            "and give its local path as data.source"
        )
        return Failure("data", f"the data source is unreachable: {_text(exc)}", fix)
    if any(isinstance(e, UnicodeDecodeError) for e in chain):
        cause = f"the data source holds a file that is not UTF-8 text: {_text(exc)}"
        fix = "remove binary files from data.source, or point it at the text files"
        return Failure("data", cause, fix)
    cause = f"reading the data failed: {_text(exc)}"
    return Failure("data", cause, "check data.source and data.cache_dir")


def record(exc: BaseException, run_dir: Path) -> Failure:
    """Write this rank's traceback and failure record under RUN_DIR/logs; the Failure."""
    rank = int(os.environ.get("RANK", "0"))
    failure = classify(exc, run_dir)
    logs = run_dir / LOGS_DIR
    log_path = logs / rank_log(rank)
    entry = {
        **asdict(failure),
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "time": time.time(),
        "traceback": str(log_path),
    }
    with contextlib.suppress(OSError):
        logs.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with log_path.open("a") as log:
            log.write(f"=== {stamp} attempt {entry['attempt']}: {failure.cause}\n")
            log.write("".join(traceback.format_exception(exc)))
        tmp = logs / f".{failure_record(rank)}.tmp"
        tmp.write_text(json.dumps(entry, indent=1) + "\n")
        os.replace(tmp, logs / failure_record(rank))
    return failure


@contextlib.contextmanager
def reported_failures(config_path: str) -> Iterator[None]:
    """Run the block; an exception that ends it is recorded (see `record`), summed up in
    one line on stderr, and the rank exits with code 1 (130 on Ctrl-C)."""
    run_dir = Path(config_path).resolve().parent
    rank = os.environ.get("RANK", "0")
    try:
        yield
    except KeyboardInterrupt:
        print(f"[trainer rank {rank}] interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except SystemExit:
        raise
    except BaseException as exc:  # every failure goes one way
        failure = record(exc, run_dir)
        where = run_dir / LOGS_DIR / rank_log(int(rank))
        line = f"[trainer rank {rank}] failed: {failure.cause}; {failure.fix} (traceback: {where})"
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
