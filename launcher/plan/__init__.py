"""Stage 3: pure arithmetic on a valid recipe: memory, cost, communication, pipeline schedules, the
layout search and the plan's report.
"""
