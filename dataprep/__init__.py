"""Data preparation, torch-free: sources and their checks, tokenizers, token formats, work units,
shards, manifests and progress. The launcher checks with it, the preparation job runs it, the
trainer reads what it wrote.
"""
