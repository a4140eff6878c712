"""pretrain: a YAML-driven launcher and trainer for GPT-style LLM pretraining.

Every module is imported under this one name (`pretrain.launcher`, `pretrain.trainer`,
`pretrain.core`, ...), so that nothing of ours shadows a user's own top-level `models` or
`trainer`, or is shadowed by one. The repository keeps the packages at its top level; in a
checkout this folder holds links to them, and an installed wheel holds them here.
"""
