"""Stage 2: every rule of a recipe, one module per topic, reported at once."""
