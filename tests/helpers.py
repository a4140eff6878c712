"""Builders and checks several test modules share (instead of importing each other)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import Problem, RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.memory_fit import check_fits
from pretrain.launcher.validate.recipe import validate

REPO = Path(__file__).resolve().parent.parent
# Published model shapes (parameter counts equal the Hugging Face checkpoints for Llama 3;
# GPT-3's and the 1T model's GeLU MLP of width 4h is a SwiGLU of width 8h/3: the same
# parameters and FLOPs).
LLAMA3_8B = ModelConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA3_405B = ModelConfig(
    vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA3_70B = ModelConfig(
    vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
GPT3_175B = ModelConfig(
    vocab_size=51200, dim=12288, n_layers=96, n_heads=96, ffn_dim=32768, max_seq_len=2048,
    tie_embeddings=True,
)  # fmt: skip
MEGATRON_1T = ModelConfig(
    vocab_size=51200, dim=25600, n_layers=128, n_heads=160, ffn_dim=68267, max_seq_len=2048,
    tie_embeddings=True,
)  # fmt: skip

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if p.stem != "base")
"""The shipped top-level recipes."""


def validate_and_fit(cfg: RecipeConfig) -> None:
    """What `action=script` checks before writing anything: the rules, then the memory fit."""
    validate(cfg)
    check_fits(cfg)


def shared_dir(factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this test session sees (the session's own temp
    dir without xdist)."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    shared = root / "shared"
    shared.mkdir(exist_ok=True)
    return shared


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """`ROOT/name`, made by `make` once per test session: the first worker to ask makes it
    while the others wait, then all read it. Something left half-made by a failed attempt
    is made again."""
    root = shared_dir(factory)
    path, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.unlink(missing_ok=True)
            make(path)
            done.touch()
    return path


def base() -> RecipeConfig:
    """A valid recipe: 8 GPUs on one node, a small model with 32 heads and 8 KV heads."""
    cfg = RecipeConfig(name="base")
    cfg.model = ModelConfig(
        vocab_size=4096, dim=512, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=1024,
        max_seq_len=1024,
    )  # fmt: skip
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 256, 2, 64
    cfg.cluster.gpus_per_node = 8
    return cfg


def compose_recipe(name: str, overrides: list[str]) -> RecipeConfig:
    """A shipped recipe composed by Hydra with command-line overrides, as the CLI does."""
    from hydra import compose, initialize_config_dir

    import pretrain.launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
    from pretrain.core.schema import to_recipe

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        return to_recipe(compose(config_name=name, overrides=overrides))


def configure(overrides: dict) -> RecipeConfig:
    """The base recipe with dotted-path overrides, as on a Hydra command line."""
    cfg = copy.deepcopy(base())
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return cfg


def problems(cfg: RecipeConfig, for_launch: bool = False) -> list[Problem]:
    """Every problem `validate` reports for `cfg` (which must have some), one per line."""
    with pytest.raises(RecipeError) as error:
        validate(cfg, for_launch=for_launch)
    assert str(error.value).splitlines() == [str(p) for p in error.value.problems]
    return error.value.problems


def pretrain(
    *args: str, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the `pretrain` CLI (as `python -P -m pretrain`: as the console script, without
    `cwd` on the import path) in `cwd` and capture its output; `env` adds variables to this
    process's environment."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "pretrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )


# Data: small corpora in every format the trainer reads, and a tokenizer for them.

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "data",
    "model",
    "token",
    "shard",
    "worker",
    "train",
    "loss",
    "batch",
    "layer",
    "attention",
    "prepare",
    "corpus",
    "weight",
]


def generated_documents(count: int, seed: int = 0, words: tuple[int, int] = (5, 120)) -> list[str]:
    """`count` documents of pseudo-random words (with some unicode), the same for a seed."""
    import random

    rng = random.Random(seed)
    docs = []
    for i in range(count):
        n = rng.randint(*words)
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        docs.append(f"Doc {i}: {text}{' café ✓' if i % 7 == 0 else ''}.")
    return docs


def write_tokenizer(path: Path, texts: list[str], vocab_size: int = 320) -> Path:
    """A byte-level BPE trained on `texts` (as the trainer trains one), saved at `path`."""
    from pretrain.dataprep.tokenizer import train_bpe

    path.parent.mkdir(parents=True, exist_ok=True)
    train_bpe([texts], vocab_size).save(str(path))
    return path


def encode_documents(tokenizer_path: Path, docs: list[str]) -> list[int]:
    """What a prepared dataset holds for `docs`: each document's ids, then EOS."""
    from tokenizers import Tokenizer

    from pretrain.dataprep.tokenizer import EOS_TOKEN

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for doc in docs:
        ids += [*tokenizer.encode(doc, add_special_tokens=False).ids, eos]
    return ids


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    """`docs` as JSON lines, compressed by the suffix (.gz, .zst, .bz2, .xz or none)."""
    import bz2
    import gzip
    import json
    import lzma

    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(docs)).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".bz2":
        data = bz2.compress(data)
    elif path.suffix == ".xz":
        data = lzma.compress(data)
    elif path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_megatron(prefix: Path, docs: list[list[int]], dtype: str = "uint16") -> Path:
    """A Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx) of one sequence per document,
    written per the documented format with numpy and struct only."""
    import struct

    import numpy as np

    codes = {"uint8": 1, "int32": 4, "int64": 5, "uint16": 8}
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]]) * itemsize
    document_index = np.arange(len(docs) + 1, dtype=np.int64)
    flat = np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if docs else []
    Path(f"{prefix}.bin").write_bytes(np.asarray(flat, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", codes[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(document_index)))
        f.write(sizes.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(document_index.tobytes())
    return prefix


def data_recipe(source: str, cache: Path, tokenizer: Path | str, **data: object) -> RecipeConfig:
    """A one-process recipe of the tiny model reading `source` with `tokenizer`."""
    cfg = RecipeConfig()
    cfg.model.vocab_size = 512
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 8, 2, 4
    cfg.cluster.device, cfg.cluster.gpu_type = "cpu", "cpu"
    cfg.data.source = source
    cfg.data.tokenizer = str(tokenizer)
    cfg.data.cache_dir = str(cache)
    cfg.data.workers = 1
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def pretrain_in_process(*args: str, cwd: Path) -> tuple[int, str, str]:
    """Run the `pretrain` CLI's main() in this process, as `pretrain ARGS` typed in `cwd`:
    (exit code, stdout, stderr). Much faster than a subprocess; any exception other than
    the CLI's own exit propagates (a traceback the user would see)."""
    from pretrain.launcher import cli

    out, err = io.StringIO(), io.StringIO()
    argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = ["pretrain", *args]
    os.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(old_cwd)
    return code, out.getvalue(), err.getvalue()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time: compare two snapshots
    to see whether anything was written."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in root.rglob("*")
    }


def wandb_records(history: Path) -> list:
    """The protobuf records of an offline W&B run's .wandb file (W&B's transaction log: a
    7-byte header, then LevelDB log records in 32 KiB blocks), parsed with W&B's own
    message types; wandb itself no longer ships a Python reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, at, records, pending = history.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B", f"{history} is not a W&B transaction log"
    while at + 7 <= len(data):
        if block - at % block < 7:  # too little room for a header: the block is padded
            at += block - at % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[at : at + 7])
        if (kind == 0 and length == 0) or at + 7 + length > len(data):
            break  # the end, or a record still being written
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_wandb_records(history: Path, timeout_s: float = 30) -> list:
    """`wandb_records` of an offline run read up to its exit record: W&B's service may still
    be writing the log when finish() returns."""
    import time

    deadline = time.monotonic() + timeout_s
    records = wandb_records(history)
    while not any(r.HasField("exit") for r in records):
        assert time.monotonic() < deadline, f"{history} never reached its exit record"
        time.sleep(0.2)
        records = wandb_records(history)
    return records


def live_processes(mentioning: str | None = None, group: int | None = None) -> list[int]:
    """PIDs of the processes still running (zombies, which have exited, count as gone) whose
    command line mentions `mentioning` and, if given, that belong to process group `group`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
            state, _ppid, pgrp = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # it ended while being read
        if state == "Z" or (group is not None and int(pgrp) != group):
            continue
        if mentioning is None or mentioning in cmdline:
            pids.append(int(proc.name))
    return pids


def wait_until_gone(
    mentioning: str | None = None, group: int | None = None, seconds: float = 60
) -> list[int]:
    """`live_processes(mentioning, group)` polled until none is left or `seconds` have
    passed: an empty list once every one has exited, else the PIDs still running. Processes
    that were told to stop take a while to do so on a loaded machine: wait for them to go
    instead of checking once."""
    import time

    deadline = time.monotonic() + seconds
    while (alive := live_processes(mentioning, group)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive
