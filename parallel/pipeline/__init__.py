"""Pipeline parallelism: the split into stages, tied embeddings across stages, MoE losses inside a
pipeline, PipeDream-2BW.
"""
