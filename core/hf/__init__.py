"""Hugging Face checkpoint formats: the Llama-shaped families, the MoE and latent-attention
families, and what keeps a model from being exported."""
