"""The pipeline schedules planned: their simulated timelines and bubble, and the V
schedules' placement."""
