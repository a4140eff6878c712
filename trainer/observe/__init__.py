"""What a run reports: metrics defined once, their sinks, the step window, memory checks, start-up
time.
"""
