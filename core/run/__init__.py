"""Names and rules of a run dir that every package shares: its files, its lock, its complete
checkpoints, credentials and durations.
"""
