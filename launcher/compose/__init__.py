"""Stage 1: the command line and the recipe files, read defensively, then composed by Hydra."""
