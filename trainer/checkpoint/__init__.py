"""Checkpoints: the sharded, atomic checkpointer, its integrity manifest, HF import and export."""
