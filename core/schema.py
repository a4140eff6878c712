"""Typed schema of a recipe: every field, its type, its default and what it means.

Hydra composes recipes over these dataclasses (registered in its ConfigStore), so an
unknown key or a value of the wrong type fails at compose time. The ranks load the run
dir's resolved `config.yaml` into the same dataclasses with `load_config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, cast

from pretrain.core.choices import CHOICES, one_of
from pretrain.core.hardware import GPUS
from pretrain.core.model_config import ModelConfig
from pretrain.core.optim_states import STATE_DTYPES
from pretrain.core.schedules import DEFAULT as DEFAULT_SCHEDULE
from pretrain.core.schedules import SCHEDULES

ACTIONS = ("run", "plan", "script", "suggest", "prepare", "dryrun", "calibrate")
PP_SCHEDULES = tuple(SCHEDULES)
DTYPES = ("fp32", "bf16", "fp16", "fp8")
FP8_BACKENDS = ("torchao", "te")
FP8_SCALINGS = ("current", "rowwise", "delayed", "mxfp8", "blockwise")
REDUCE_DTYPES = ("fp32", "bf16")
OFFLOAD_MODES = ("none", "params")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
RECOMPUTE_POLICIES = ("none", "full", "selective")
OPTIMIZERS = ("adamw", "lion", "sgd", "muon")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "hf_disk", "nanogpt", "megatron", "prepared")
CLUSTER_BACKENDS = ("local", "slurm")
DEVICES = ("cuda", "cpu")
GPU_TYPES = tuple(GPUS)
WANDB_MODES = ("auto", "online", "offline", "disabled")
ASYNC_MODES = ("none", "thread", "process")
RECOVERY_ACTIONS = ("halt", "skip", "rollback")
SPIKE_ACTIONS = ("none", *RECOVERY_ACTIONS)
ALERT_ACTIONS = ("none", "halt", "rollback")
PLAN_FORMATS = ("table", "json")
PLAN_BEFORE_RUN = ("summary", "full", "none")
PLAN_CHARTS = ("text", "png")
STABILITY_ALERTS = {
    "attn_logit_max": 100.0,
    "z_mean": 1000.0,
    "act_rms_max": 0.0,
    "update_ratio_max": 1.0,
    "grad_norm_max": 0.0,
}
"""The alert threshold of each monitor that can raise one (logging.stability_alerts): the
largest attention logit above 100 (the logit Kimi K2's QK-clip caps), a z-mean above 1000
(|logsumexp| above about 32), an update as large as the weight it changes; the activation
RMS and the per-layer gradient norm have no threshold that fits every model (0: off)."""
_INTERPOLATION = re.compile(r"(\\*)\$\{")


@dataclass
class ParallelConfig:
    """Parallel degrees; their product is the world size (nodes x gpus_per_node)."""

    tp: int = 1
    """Tensor-parallel degree; GPUs of one node split each layer's matrices."""
    sp: bool = False
    """Sequence parallelism: shard norms and residuals along the sequence inside TP."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over cp ranks (rank i takes chunks i
    and 2cp-1-i of 2cp, which balances the causal mask) and attention exchanges keys and
    values around a ring; the cp ranks of a sequence also share the gradient reduction."""
    pp: int = 1
    """Pipeline-parallel degree: stages, usually across nodes."""
    vpp: int = 1
    """Virtual pipeline stages per rank (model chunks) for interleaved schedules."""
    pp_schedule: str = one_of(DEFAULT_SCHEDULE, PP_SCHEDULES)
    """Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (PipeDream-Flush),
    interleaved_1f1b (over vpp chunks per rank), zero_bubble (backward split into input and
    weight gradients, the latter filling the bubbles; any vpp), zbv or dualpipev (vpp=2 chunks
    placed in a V: rank r holds stages r and 2pp-1-r; ZB-V and DeepSeek's DualPipeV), or 2bw
    (PipeDream-2BW: 1F1B with no flush between optimizer steps, two weight versions per
    stage, each step's gradients applied one step late; vpp=1)."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline step; 0 means the gradient-accumulation count. Otherwise it
    splits each dp rank's micro_batch x accumulation sequences into this many equal parts."""
    pp_layers: list[int] = field(default_factory=list)
    """Layers of each of the pp * vpp stages in model order, for uneven splits (the first and
    last stages also hold the embedding and the head); empty splits the layers evenly."""
    dp_replicate: int = 1
    """Data-parallel replicas (the outer, replicated dim of hybrid sharding)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard under ZeRO >= 1 (plain replicas under ZeRO 0); -1 fills
    what the other degrees leave of the world size."""
    zero: int = 0
    """ZeRO stage: 0 = DDP, 1 = sharded optimizer states, 2 = + gradients, 3 = + parameters."""
    offload: str = one_of("none", OFFLOAD_MODES)
    """none, or params: with ZeRO-2/3, keep each rank's FP32 parameter shards, gradients and
    optimizer states in host memory and run the optimizer step on the host (FSDP2's
    CPUOffloadPolicy); the device keeps the unsharded copies of the blocks in use."""
    ep: int = 1
    """Expert-parallel degree (MoE models), carved from the data-parallel ranks."""
    etp: int = 1
    """Expert tensor-parallel degree (MoE models): each routed expert's matrices are split
    over etp ranks of the tp group (gate and up projections by column, the down projection
    by row, the partial outputs summed over etp); 1 keeps every expert whole on each tp rank.
    Must divide tp: the experts' mesh is (edp, ep, tp / etp, etp) beside attention's tp x cp
    x dp, the tp / etp ranks holding the same shards."""
    allow_tp_across_nodes: bool = False
    """Permit tp larger than one node's GPUs (slow: TP traffic leaves NVLink)."""
    fsdp_prefetch: int = 1
    """FSDP2: blocks whose all-gathers are issued ahead, in forward and in backward (0 leaves
    FSDP2's implicit prefetching)."""
    ddp_bucket_mb: float = 25.0
    """DDP: gradient bucket size in MiB; a bucket's all-reduce overlaps the rest of backward."""


@dataclass
class PrecisionConfig:
    """Numeric precision of compute, parameters and gradient reduction."""

    dtype: str = one_of("fp32", DTYPES)
    """Compute dtype: fp32; bf16 (FP32 master weights, reduction in reduce_dtype); fp16 (the
    same with dynamic loss scaling); fp8 (the blocks' linear layers in FP8, the rest in bf16)."""
    fp8_backend: str = one_of("torchao", FP8_BACKENDS)
    """FP8 implementation: torchao (float8 training; composes with FSDP2 and DTensor) or te
    (NVIDIA Transformer Engine, the `te` extra; CUDA only)."""
    fp8_recipe: str = one_of("current", FP8_SCALINGS)
    """FP8 scaling: current (per-tensor scales from this step's amax), rowwise (torchao: a scale
    per row), delayed (te: scales from an amax history), mxfp8 (MX block scaling: a power-of-two
    scale per 32 elements; Blackwell, or torchao's emulation) or blockwise (DeepSeek-V3's:
    activations in 1 x 128 tiles, weights in 128 x 128 blocks; Hopper and newer, CUDA only).
    Under torchao the routed experts of a MoE model run their grouped GEMM in FP8 too where the
    scaling has a grouped form (rowwise, mxfp8, blockwise); the router never runs in FP8."""
    fp8_amax_history: int = 1024
    """fp8_recipe=delayed: steps of amax history the scale is computed from."""
    fp8_margin: int = 0
    """fp8_recipe=delayed: the scale leaves 2**margin of headroom below the FP8 maximum."""
    fp8_all_gather: bool = False
    """torchao with FSDP2 (ZeRO-2/3): all-gather weights in FP8 (half the bytes of bf16)."""
    fp8_emulate: bool = False
    """torchao only: emulate the FP8 matmuls in high precision, so the FP8 code path runs where
    no FP8 tensor cores are (CPU tests). Numerics of FP8, speed of neither."""
    loss_scale_init: float = 65536.0
    """fp16: initial loss scale."""
    loss_scale_growth: float = 2.0
    """fp16: factor the scale grows by after `loss_scale_interval` steps without overflow."""
    loss_scale_backoff: float = 0.5
    """fp16: factor the scale shrinks by when a step's gradients overflow (the step is skipped)."""
    loss_scale_interval: int = 2000
    """fp16: overflow-free steps between two growths of the loss scale."""
    reduce_dtype: str = one_of("fp32", REDUCE_DTYPES)
    """Dtype of the data-parallel gradient reduction: fp32, or bf16 (half the traffic; FSDP2's
    reduce_dtype, a bf16 compression hook under DDP)."""


@dataclass
class CompileConfig:
    """torch.compile, applied per transformer block and to the loss."""

    enabled: bool = False
    """Compile at all; blocks and loss choose what."""
    blocks: bool = True
    """Compile each transformer block's forward (one graph shared by identical blocks)."""
    loss: bool = True
    """Compile the loss (cross-entropy over the logits)."""
    backend: str = one_of("inductor", COMPILE_BACKENDS)
    """torch.compile backend: inductor, aot_eager or eager (the last two for debugging)."""
    fallback: bool = False
    """If a block or the loss fails to compile, run it eagerly (and log it) instead of stopping."""


@dataclass
class RecomputeConfig:
    """Activation recomputation (checkpointing) policy."""

    policy: str = one_of("none", RECOMPUTE_POLICIES)
    """none; full (recompute whole blocks); selective (keep matmul outputs, recompute the
    attention core and elementwise ops; under tp a row-parallel projection keeps its reduced
    output instead of its partial sum, recomputing the attention's output projection)."""
    every: int = 1
    """With policy=full: recompute every k-th block (1 = all blocks)."""


@dataclass
class OptimConfig:
    """Optimizer and gradient clipping."""

    name: str = one_of("adamw", OPTIMIZERS)
    """adamw, lion, sgd or muon (Muon on the blocks' weight matrices, AdamW with `betas` and
    `eps` on embeddings, head, norms and biases; trainer/optim/muon.py)."""
    lr: float = 3e-4
    """Peak learning rate (after warmup, before any batch-size scaling)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam/Lion betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.9
    """SGD momentum; Muon's (Nesterov) momentum (its authors use 0.95)."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms, biases or embeddings."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    lr_scaling: str = one_of("none", LR_SCALINGS)
    """Scale lr with the global batch: none, linear or sqrt (relative to base_batch)."""
    base_batch: int = 0
    """Global batch (sequences) that `lr` was tuned for; needed when lr_scaling != none."""
    state_dtype: str = one_of("fp32", STATE_DTYPES)
    """Dtype of the optimizer states (adamw, lion, muon): fp32; bf16; int8 or int4 (blocks of
    32 along the last dim with an FP32 scale each, dynamic code maps; trainer/optim/states.py).
    The update itself runs in FP32; checkpoints hold the states in FP32."""
    distributed_muon: bool = True
    """Muon with more than one data-parallel rank: split the Newton-Schulz work over them, each
    matrix orthogonalized by one rank and the result sent to the others (under FSDP2 each
    matrix's slices go to its owner and come back; under DDP and with TP an all-gather of the
    results follows). The same update as without it; false makes every rank orthogonalize
    every matrix it holds (trainer/optim/distributed_muon.py)."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule."""

    name: str = one_of("cosine", LR_SCHEDULES)
    """cosine, linear, constant or wsd (warmup-stable-decay)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak lr."""
    decay_steps: int = 0
    """cosine/linear: steps of decay after warmup (0 = until train.steps). wsd: length of the
    final cooldown to min_lr (0 = 20% of train.steps)."""


@dataclass
class BatchStage:
    """One stage of `train.batch_schedule`."""

    global_batch: int = 0
    """Sequences per optimizer step during the stage (below train.global_batch)."""
    until_tokens: int = 0
    """The stage lasts until this many tokens were trained: the first step that starts at or
    past it runs the next stage (train.global_batch after the last)."""


@dataclass
class SeqLenStage:
    """One stage of `train.seq_len_schedule`."""

    seq_len: int = 0
    """Tokens per sequence during the stage: a divisor of train.seq_len below it, so each
    full-length sequence of the data order is cut into train.seq_len / seq_len pieces."""
    until_tokens: int = 0
    """The stage lasts until this many tokens were trained: the first step that starts at or
    past it runs the next stage (train.seq_len after the last)."""


@dataclass
class TrainConfig:
    """Batching and length of the run."""

    steps: int = 100
    """Optimizer steps."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch: int = 4
    """Sequences per rank per forward/backward."""
    global_batch: int = 16
    """Sequences per optimizer step across all data-parallel ranks."""
    loss_chunks: int = 1
    """Compute the LM head and cross-entropy in this many sequence chunks, each recomputed
    in backward, so the full logits and their gradient never exist at once (costs one more
    head matmul per step); 1 computes them whole. Must divide seq_len."""
    batch_schedule: list[BatchStage] = field(default_factory=list)
    """A batch-size ramp (GPT-3's, OLMo's): smaller global batches first, in stages of growing
    batch, each until a number of tokens trained; train.global_batch after the last. The data
    order is the same stream of sequences cut into other batches. Empty: train.global_batch
    throughout. Under any ramp the LR schedule runs by tokens (core/data_order/ramps.py)."""
    seq_len_schedule: list[SeqLenStage] = field(default_factory=list)
    """A sequence-length warm-up: shorter sequences first, in stages of growing seq_len, each
    until a number of tokens trained; train.seq_len after the last. Empty: train.seq_len
    throughout."""


@dataclass
class SourceConfig:
    """One source of a mixture (`data.sources`); its fields mean what data's fields of the
    same name mean for the single `data.source`."""

    source: str = ""
    """What `data.source` takes: a path, a glob, `stdlib`, `hf:NAME` or a prepared dataset."""
    weight: float = 1.0
    """Share of every global batch drawn from this source, relative to the others' weights."""
    name: str = ""
    """Label of the source in the metrics (tokens_seen_NAME); empty derives one from source."""
    format: str = one_of("auto", DATA_FORMATS)
    """As data.format."""
    text_field: str = "text"
    """As data.text_field."""
    split: str = "train"
    """As data.split."""
    max_bytes: int = 0
    """As data.max_bytes."""
    max_tokens: int = 0
    """As data.max_tokens."""
    vocab_size: int = 0
    """As data.vocab_size."""


CACHE_DIR_VARIABLE = "PRETRAIN_CACHE_DIR"
"""The environment variable that moves every run's default cache (a shared disk, a test
session's own folder)."""


def default_cache_dir() -> str:
    """data.cache_dir's default: `$PRETRAIN_CACHE_DIR` when set, else ~/.cache/pretrain."""
    return os.environ.get(CACHE_DIR_VARIABLE) or "~/.cache/pretrain"


@dataclass
class MixturePhase:
    """One phase of `data.mixture_schedule`."""

    name: str = ""
    """Label of the phase in the log and the plan (e.g. anneal); empty: phase N."""
    from_tokens: int = 0
    """The phase begins once this many tokens were trained (the first phase at 0)."""
    weights: list[float] = field(default_factory=list)
    """Each source's weight during the phase, one per data.sources entry in order (0 leaves a
    source out); normalized to shares of every global batch."""
    blend: bool = False
    """Move the shares linearly with the tokens trained, from this phase's to the next
    phase's (reached at its start): a piecewise-linear schedule. false holds them."""


@dataclass
class DataConfig:
    """Training corpus, tokenizer, preparation and the validation split.

    A corpus is prepared once (`action=prepare`, or by a local run that finds it missing)
    into token shards under cache_dir/datasets; the ranks memory-map them."""

    source: str = "stdlib"
    """`stdlib` (this Python's standard-library sources, no download), a local file,
    directory or glob of text/JSONL/Parquet files (also .gz/.zst/.bz2/.xz compressed, in
    nested directories), a Hugging Face `save_to_disk` directory, a nanoGPT token file
    (`.bin` of uint16), a Megatron indexed dataset (`PREFIX` of PREFIX.bin + PREFIX.idx), a
    prepared dataset directory, or `hf:NAME[:CONFIG]` for a Hugging Face hub dataset."""
    format: str = one_of("auto", DATA_FORMATS)
    """auto (from the path: extensions, a .bin's .idx, the directory's own files), text (a
    file is a document), jsonl, parquet, hf_disk, nanogpt, megatron or prepared."""
    text_field: str = "text"
    """Column holding the document text in JSONL/Parquet/Hugging Face datasets."""
    split: str = "train"
    """Split of a hub dataset, or of a saved DatasetDict."""
    tokenizer: str = "train"
    """`train`: a byte-level BPE of model.vocab_size trained on the text sources (cached);
    a tokenizer.json path or a Hugging Face tokenizer directory; or `none` when every source
    is already tokenized (nanoGPT, Megatron)."""
    max_bytes: int = 0
    """Read documents until this many bytes of text (the one that reaches it is kept whole;
    0 = all)."""
    max_tokens: int = 0
    """Prepare documents until this many tokens (the one that reaches it is kept whole;
    0 = all): what train.steps x global_batch x seq_len needs, plus the validation split."""
    vocab_size: int = 0
    """Vocabulary of a pre-tokenized source's ids (nanoGPT, Megatron); 0 reads a nanoGPT
    meta.pkl beside the .bin, else the ids are checked against model.vocab_size."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture: each global batch draws from every source in proportion to its
    weight. Empty: the one source above (data.source and its fields)."""
    mixture_schedule: list[MixturePhase] = field(default_factory=list)
    """Weights of data.sources that change with the tokens trained, in phases (a final anneal
    on the best data, or shares that move linearly); each step draws by the shares at its
    first token, and every source's count stays within a sequence or two of its shares'
    running total. Empty: the sources' own weights throughout; they still mix the validation
    batches either way."""
    val_fraction: float = 0.0
    """Documents held out for validation, at the end of each token shard of every source."""
    val_source: str = ""
    """A separate validation source (any kind data.source takes) instead of val_fraction."""
    doc_mask: bool = False
    """Document-aware attention: inside a packed sequence a token attends only to earlier
    tokens of its own document (block-causal, split at the end-of-sequence token)."""
    workers: int = 0
    """Processes that tokenize in parallel during preparation; 0 = the cores available."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where prepared datasets, trained tokenizers and this machine's measured CPU peak are
    cached (shared by runs): `$PRETRAIN_CACHE_DIR` when set, else ~/.cache/pretrain."""
    prefetch: int = 2
    """Steps of micro-batches a background thread reads ahead (pinned on CUDA); 0 reads in
    the loop."""


@dataclass
class EvalConfig:
    """Validation loss on the held-out split, through the same parallel layout (forward only)."""

    every: int = 0
    """Evaluate every this many steps and at the end of the run (0: never)."""
    batches: int = 4
    """Global batches of validation sequences per evaluation; the same ones every time."""
    tasks: list[str] = field(default_factory=list)
    """Downstream multiple-choice tasks scored through the training layout (forward only):
    each a local JSONL file of {"context", "choices", "answer"} examples (named by the
    file's stem), or `lm_eval:TASK`, an lm-eval task whose data is local (the `lm-eval`
    extra; its YAML folder in eval.lm_eval_include). Logged as eval/<task>/acc and
    eval/<task>/acc_norm."""
    tasks_every: int = 0
    """Score eval.tasks every this many steps and at the end of the run (0: never)."""
    lm_eval_include: str = ""
    """A folder of lm-eval task YAML files (their data in local files) that `lm_eval:TASK`
    entries of eval.tasks may name, beside lm-eval's own tasks; empty: lm-eval's only."""


@dataclass
class InitConfig:
    """Where the initial weights come from (a resumed run loads its checkpoint instead)."""

    from_hf: str = ""
    """A Hugging Face Llama directory (config.json and *.safetensors, as pretrain-export and
    transformers write them) to start from; empty: initialize from the seed."""


@dataclass
class ContainerConfig:
    """A container every node's task runs in (SLURM with the pyxis/enroot plugin)."""

    image: str = ""
    """Image for `srun --container-image`, e.g. nvcr.io/nvidia/pytorch:25.01-py3 or a
    .sqsh file; empty: no container. pretrain must be installed in it (or mounted)."""
    mounts: list[str] = field(default_factory=list)
    """`--container-mounts` entries SRC:DST[:FLAGS] with absolute paths; the run dir is
    always mounted at its own path."""


@dataclass
class ClusterConfig:
    """Where and how the job runs."""

    backend: str = one_of("local", CLUSTER_BACKENDS)
    """local (torchrun on this machine) or slurm (sbatch)."""
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 1
    """Ranks per node: GPUs, or CPU processes when device=cpu."""
    device: str = one_of("cuda", DEVICES)
    """cuda or cpu (gloo backend; for tests and the embedded default)."""
    gpu_type: str = one_of("h100_sxm", GPU_TYPES)
    """Accelerator model, for peak FLOP/s and memory (see core/hardware.py)."""
    gpu_memory_gib: float = 0.0
    """Memory per GPU in GiB; 0 takes it from gpu_type."""
    partition: str = ""
    """SLURM partition (empty: the cluster default)."""
    account: str = ""
    """SLURM account (empty: none)."""
    qos: str = ""
    """SLURM quality of service (empty: none)."""
    cpu_partition: str = ""
    """SLURM partition of CPU-only jobs (action=prepare); empty: cluster.partition."""
    time: str = "01:00:00"
    """SLURM time limit: [D-]HH:MM:SS."""
    cpus_per_task: int = 8
    """CPU cores per node's task (data loading threads)."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM sends SIGUSR1."""
    master_port: int = 0
    """Rendezvous port on the first node; 0: one port per job (10000 + SLURM_JOB_ID % 20000),
    so that jobs sharing a node never meet in each other's rendezvous."""
    omp_num_threads: int = 1
    """OMP_NUM_THREADS for every rank."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the ranks (e.g. NCCL settings)."""
    sbatch_template: str = ""
    """Your own sbatch template (absolute path) with the same ${placeholders} as
    slurm/sbatch.template; empty: the shipped one."""
    sbatch_extra: list[str] = field(default_factory=list)
    """Extra #SBATCH directives, each `--name=value` or `--flag`, e.g. --constraint=h100,
    --exclusive; the value is quoted for sbatch."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run on each node before torchrun (in the container, if any), e.g.
    `module load cuda/12.4`, `source /opt/venv/bin/activate`; SLURM only."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    python: str = ""
    """The Python that runs torchrun on each node: a command on the node's PATH or an
    absolute path; empty: the launcher's own interpreter (inside cluster.container: python3)."""
    max_restarts: int = 0
    """torchrun restarts the whole group this many times when a rank dies; the restarted
    ranks resume from the last complete checkpoint."""
    min_nodes: int = 0
    """SLURM: the fewest nodes the job may continue on when it loses nodes; it keeps its
    allocation (`--no-kill`) and resumes from the last checkpoint on the nodes left, with a
    layout the launcher chose for that many nodes at submission. 0: a lost node fails the
    job."""


@dataclass
class HardwareConfig:
    """Device facts used by the metrics and the planner."""

    peak_tflops: float = 0.0
    """Peak dense TFLOP/s per device for the compute dtype; 0 takes it from the GPU table (or,
    on CPU, from the machine's peak, measured once and cached under data.cache_dir)."""
    intra_node_gbs: float = 0.0
    """GB/s per GPU and direction to the GPUs of its own node (NVLink) the planner costs
    collectives at; 0 takes the GPU table's (core/hardware.py LINKS)."""
    inter_node_gbs: float = 0.0
    """GB/s per GPU and direction to other nodes (its share of the node's NICs) the planner
    costs collectives at; 0 takes the GPU table's."""
    intra_node_latency_us: float = 0.0
    """Microseconds one step of a collective or one send costs inside a node; 0 takes the
    table's (2 us)."""
    inter_node_latency_us: float = 0.0
    """Microseconds one step of a collective or one send costs between nodes; 0 takes the
    table's (5 us)."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    log_every: int = 1
    """Log every this many steps."""
    wandb: str = one_of("auto", WANDB_MODES)
    """Weights & Biases: auto (online with an API key, offline without), online, offline or
    disabled."""
    wandb_project: str = ""
    """W&B project; empty means $WANDB_PROJECT where set, else `pretrain`. The launcher
    writes the project it chose into the run's config, so a resumed job logs to the same."""
    wandb_entity: str = ""
    """W&B entity (empty: the default of the API key)."""
    wandb_name: str = ""
    """W&B run name; empty: the recipe's name, and in a sweep the point's overrides after it."""
    wandb_group: str = ""
    """W&B group; empty: none, in a sweep the recipe and the swept keys (one group per
    sweep, kept when a point resumes), and on several nodes the run dir's name (beside the
    runs of the other nodes' system metrics)."""
    wandb_job_type: str = "train"
    """W&B job_type, to filter runs in the workspace."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags added to the automatic ones (the recipe, the layout, the precision)."""
    system_every_s: float = 60.0
    """Each node's CPU utilisation, memory in use and load (and on CUDA its GPU's
    utilisation, memory, power and temperature) as `system/<host>/*` metrics, sampled by
    its first rank at most this often; 0: never (W&B records its own system metrics
    besides)."""
    tensorboard: bool = False
    """Also write every scalar as TensorBoard events under RUN_DIR/tensorboard
    (`pip install tensorboard`; read with `tensorboard --logdir RUN_DIR`)."""
    all_ranks: bool = False
    """Print the trainer's messages from every rank (prefixed with the rank), not only rank 0."""
    stability_every: int = 100
    """Sample the stability monitors every this many steps (0: never): per-layer gradient
    norm, parameter norm and update-to-weight ratio, RMS of each block's output, the
    largest attention logit per layer and the output logits' z-mean (docs/metrics.md)."""
    stability_alerts: dict[str, float] = field(default_factory=lambda: dict(STABILITY_ALERTS))
    """Thresholds of the sampled monitors (attn_logit_max, z_mean, act_rms_max,
    update_ratio_max, grad_norm_max): a sampled value above its threshold is a warning line
    and a W&B alert; 0 turns that alert off. Unnamed monitors keep their defaults."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints under RUN_DIR/checkpoints; a run dir that has one resumes from it."""

    every: int = 100
    """Save every this many steps (0: only at the end and when the job is asked to stop)."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted once a newer one is complete."""
    async_mode: str = one_of("none", ASYNC_MODES)
    """none (training waits for the save), thread or process (shards are written in the
    background while training continues; marked complete when written)."""
    hf_every: int = 0
    """Also write a Hugging Face folder (safetensors shards and their index, config.json, the
    tokenizer) every this many steps, under RUN_DIR/hf/step_N, each rank its own tensors
    (never the model gathered on one rank); the newest `keep` are kept. 0: never (export a
    checkpoint with `pretrain export` instead)."""


@dataclass
class FaultConfig:
    """How the trainer reacts to bad steps, hangs and slow ranks."""

    max_bad_steps: int = 5
    """Stop after this many consecutive steps that were skipped (a non-finite loss or
    gradient norm under on_nan=skip, a spike under on_spike=skip), or at a rollback to a
    checkpoint the run already rolled back to this many times."""
    on_nan: str = one_of("skip", RECOVERY_ACTIONS)
    """A step with a non-finite loss or gradient norm on any rank: skip (no update, the batch
    is dropped), halt (stop at once, the step unsaved) or rollback (reload the newest
    checkpoint and skip the data from it to this step's batch; see rollback_lr_factor)."""
    on_spike: str = one_of("none", SPIKE_ACTIONS)
    """A loss spike (the step's loss above spike_factor times the median of the last
    spike_window steps' losses, averaged over the ranks): none (train on), skip, halt or
    rollback, as for on_nan."""
    spike_factor: float = 3.0
    """A spike is a loss above this many times the running median (> 1)."""
    spike_window: int = 50
    """Steps whose losses the running median is taken over; no step is a spike before the
    window is full. Skipped steps do not enter it; a checkpoint keeps it."""
    on_alert: str = one_of("none", ALERT_ACTIONS)
    """A stability monitor above its threshold (logging.stability_alerts, at the steps
    logging.stability_every samples; every rank sees the same values): none (the warning and
    the W&B alert only), halt or rollback, as for on_nan. There is no skip: the monitors are
    summed after the step's update, which only a rollback undoes."""
    rollback_lr_factor: float = 1.0
    """After a rollback, the learning rate is multiplied by this (0 < factor <= 1) ..."""
    rollback_lr_steps: int = 0
    """... for this many steps (0: not lowered)."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait before it fails with an error instead of hanging, and
    the hang watchdog's limit, until measured times replace it: always for start-up and the
    exit, for the first save and the first evaluation until one was timed, for the first
    steps unless first_step_timeout_s is set, throughout with timeout_factor=0."""
    timeout_factor: float = 10.0
    """After the first steps, the collective timeout and the hang watchdog's limit are this
    many times the longest measured time of the phase the loop is in (a training step, a
    checkpoint save, an evaluation), and never below timeout_floor_s; 0 keeps
    collective_timeout_s throughout (0, or >= 2)."""
    timeout_floor_s: float = 60.0
    """The least timeout the measured times may set, in seconds (> 0)."""
    first_step_timeout_s: float = 0.0
    """The timeout of the steps before one was measured, in seconds; 0: resolved by the
    launcher from the plan's predicted step time (timeout_factor times it, at least
    timeout_floor_s), or collective_timeout_s when the plan predicts none or the model is
    compiled (compilation is not predicted)."""
    straggler_lag: float = 0.25
    """Name a rank whose own compute per step exceeds the median of the other ranks doing the
    same work by this fraction (and by more than 50 ms)."""


@dataclass
class RunConfig:
    """The run directory."""

    dir: str = ""
    """Run directory; empty means runs/<recipe name> (plus the override string in a sweep)."""


@dataclass
class PlanConfig:
    """How the plan prints."""

    format: str = one_of("table", PLAN_FORMATS)
    """table or json."""
    chart: str = one_of("text", PLAN_CHARTS)
    """The pipeline schedule's chart: text (in the plan), or png to draw it too, as
    pipeline.png in the current directory (action=plan, with pp > 1)."""
    before_run: str = one_of("summary", PLAN_BEFORE_RUN)
    """What `action=run` and `action=script` print of the plan before the job: summary (a
    few lines: layout, size, memory, speed and every warning), full (what action=plan
    prints) or none."""
    dryrun: bool = False
    """Dry-run the fullest rank (action=dryrun) before a SLURM submission, and refuse the job
    if the dry run fails or does not fit; costs about a minute."""


@dataclass
class DryrunConfig:
    """What action=dryrun runs: one rank of the job, under fake collectives and tensors."""

    rank: int = -1
    """The rank to dry-run; -1 picks the one the plan says holds the most memory."""


@dataclass
class CalibrateConfig:
    """What action=calibrate measures on the job's own ranks: the rates the cost model
    prices the step at (GEMMs, attention, memory, collectives at the run's sizes), then the
    step of each layout it times, compared with the plan's prediction."""

    steps: int = 5
    """Steps timed per layout, after one untimed (their median is compared with the plan)."""
    layouts: list[str] = field(default_factory=list)
    """More layouts to time in the same job, each a space-separated list of the recipe's
    own layout fields (`parallel.*`, `recompute.*`, `train.micro_batch`), e.g.
    "parallel.zero=3" or "parallel.tp=2 parallel.sp=true"; the recipe's own layout is timed
    first."""


@dataclass
class SuggestConfig:
    """How action=suggest reports."""

    top: int = 5
    """Layouts listed, fastest first."""


@dataclass
class RecipeConfig:
    """A whole recipe: what to train, how to lay it out, and where to run it."""

    name: str = "tiny"
    """Recipe name; names the run dir and the W&B run."""
    action: str = one_of("run", ACTIONS)
    """run (plan, write the run dir, launch or submit), plan (print only) or script
    (write the run dir and job script, launch nothing) or suggest (list the fastest layouts
    of the model on the cluster that fit; launcher/plan/suggest.py) or prepare (tokenize the
    data into a prepared dataset, here or as a CPU-only SLURM job) or dryrun (build one rank
    of the job and run one step under fake collectives and fake tensors; compare with the
    plan) or calibrate (measure this hardware's rates on the job's ranks, here or as a SLURM
    job, into data.cache_dir/hardware; plan and suggest then price steps at them)."""
    seed: int = 1234
    """Seed for weights and data order; the same seed gives the same run in every layout."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    init: InitConfig = field(default_factory=InitConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    suggest: SuggestConfig = field(default_factory=SuggestConfig)
    dryrun: DryrunConfig = field(default_factory=DryrunConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)


def choice_fields(
    cls: type | None = None, prefix: str = ""
) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(dotted field path, allowed values) of every `one_of` field under `cls` (the recipe)."""
    for f in fields(cls or RecipeConfig):
        if CHOICES in f.metadata:
            yield prefix + f.name, f.metadata[CHOICES]
        sub = f.default_factory if callable(f.default_factory) else None
        if sub is not None and is_dataclass(sub):
            yield from choice_fields(sub, f"{prefix}{f.name}.")


def field_value(cfg: Any, path: str) -> Any:
    """The value of a dotted field path, e.g. `parallel.pp_schedule`."""
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def schema_node() -> Any:
    """The schema as the OmegaConf node recipes compose over, with every field's default.

    model.head_dim reads back as the head width (dim / n_heads when unset), and OmegaConf
    reads a default instance's fields by attribute: its raw default (0) is restored here, so
    that a recipe's own dim and n_heads decide the width.
    """
    from omegaconf import OmegaConf

    node = OmegaConf.structured(RecipeConfig)
    node.model.head_dim = 0
    return node


def to_recipe(node: Any) -> RecipeConfig:
    """Turn a composed OmegaConf node (or a plain dict) into a typed RecipeConfig."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(schema_node(), node)
    return cast(RecipeConfig, OmegaConf.to_object(merged))


def load_config(path: str) -> RecipeConfig:
    """Load a run dir's resolved config.yaml into the typed schema (what every rank does),
    through the reading layer: a file that is not a regular, bounded, UTF-8 YAML mapping of
    the schema's fields is a ReadError naming it and the field at fault."""
    from pathlib import Path

    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pretrain.core.inputs.reading import ReadError, read_text, yaml_shape_problem

    expected = "a run's config.yaml (the resolved recipe the launcher wrote)"
    fix = "write it again: pretrain ... action=script"
    text = read_text(Path(path), expected)
    problem = yaml_shape_problem(text)
    if problem is not None:
        raise ReadError(path, problem, expected, fix)
    try:
        # OmegaConf asserts (an AssertionError) on a file that holds one scalar: refused here.
        top = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if isinstance(top, yaml.ScalarNode):
            found = f"holds the single value {top.value!r:.60}, not a mapping of fields"
            raise ReadError(path, found, expected, fix)
        node = OmegaConf.create(text)  # OmegaConf's own YAML rules, as OmegaConf.load
        if not isinstance(node, DictConfig):
            raise ReadError(path, "holds a list, not a mapping of fields", expected, fix)
        return to_recipe(node)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as err:
        if isinstance(err, ReadError):
            raise
        key = getattr(err, "full_key", None)
        found = f"{key}: " if key else ""
        found += str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ReadError(path, found, expected, fix) from None


def dump_config(cfg: RecipeConfig) -> str:
    """The resolved recipe as YAML text that `load_config` reads back to an equal recipe.

    A string that holds `${` (an interpolation the user escaped, so a literal) is written
    escaped: the ranks must see the value the launcher validated, not resolve it again.
    """
    from omegaconf import OmegaConf

    data = asdict(cfg)
    # As given (0: dim / n_heads), not the width it reads back as: the file says what was asked.
    data["model"]["head_dim"] = cfg.model.explicit_head_dim
    return OmegaConf.to_yaml(OmegaConf.create(_escape_interpolations(data)))


def _escape_interpolations(node: Any) -> Any:
    """`node` with every `${` in its strings escaped for OmegaConf (and the backslashes
    right before one doubled, so they stay literal too)."""
    if isinstance(node, dict):
        return {key: _escape_interpolations(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_interpolations(value) for value in node]
    if isinstance(node, str) and "${" in node:
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", node)
    return node
