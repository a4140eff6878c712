"""The data a rank reads: prepared datasets, the seeded sampler, loaders and prefetch."""
