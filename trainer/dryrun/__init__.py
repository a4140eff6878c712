"""A dry run of one rank of a job: the real build and one real training step under a fake
process group of the job's world size and fake tensors, measured (`trainer/dryrun/run.py`)."""
