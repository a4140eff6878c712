"""Names the dead-code check (vulture, in .ci/run) cannot see used: what Python, torch or a
library reads by name, and the few product entry points only tests and bench/ drive.

vulture counts a name as used wherever it appears, so each line below only names one. A
name that stops being used goes from here too.
"""

# ruff: noqa: B018

_ = object()

# Read by the standard library, torch or a library, by name.
_.idpattern  # string.Template's placeholder pattern (launcher/assets.py)
_.find_class  # pickle.Unpickler's hook (dataprep/token_formats.py)
_.pre_tokenizer  # tokenizers.Tokenizer's settings (dataprep/tokenizer.py)
_.decoder
_.__spec__  # cleared before the workers fork (dataprep/workers.py)
_.exc_info  # logging.LogRecord's traceback, dropped by the agent's filter (trainer/agent.py)
_.exc_text
_._CHECKPOINT_PROCESS  # DCP's background process, released to join it (trainer/checkpoint)
_.donated_buffer  # AOTAutograd's setting, off under split-backward schedules (parallel/compile.py)
_.tb  # __exit__'s third argument
_.types  # TorchDispatchMode.__torch_dispatch__'s signature (trainer/kernels.py)

# The terms of core/run/goodput.py's Breakdown: read together through dataclasses.fields.
_.checkpoint_save_s
_.checkpoint_load_s
_.startup_s
_.evaluation_s
_.recomputed_s
_.failures_s
_.between_jobs_s
_.shutdown_s

# Fields that benchmarks and tests read.
_.optimizer_states  # launcher/plan/memory.py's breakdown: bench/optim_state_memory.py
_.state_nbytes  # trainer/optim/states.py: bench/optim_state_memory.py
_.fell_back  # parallel/compile.py's fallback flag: tests/unit/test_compile.py
_.ranked  # launcher/plan/suggest.py's every fitting layout: tests/unit/test_published_layouts.py

# Product entry points that tests and bench/ drive.
_.wait_for_slurm_job  # launcher/job/backends.py: tests/slurm
_.init_weights  # models/init.py (a plain model on CPU): unit tests
_.LocalTransport  # parallel/pipeline/pipedream.py's one-process pipeline: tests, oracles
_.local_step
_.local_drain
_.newest
_.one_process_loader  # trainer/data/loader.py: bench/, tests/pipedream_oracle.py
_.read_png_data  # launcher/report.py: reads a report's panel data back (docs/metrics.md)
_.dashboard  # launcher/entry.py: the pretrain-dashboard console script (pyproject.toml)

# torch's own attributes, set from outside by the dry run (trainer/dryrun/fake.py).
_._inference_mode  # a pipeline stage's metadata mode, read by torch's schedule
_._runtime_validate  # torch checks a stage's tensors against its shapes when set

# lm-eval's LM interface, called by lm-eval (trainer/evals/lm_eval_adapter.py).
_.loglikelihood
_.loglikelihood_rolling
_.generate_until
