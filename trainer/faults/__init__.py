"""What goes wrong in a long run: step guards and stop signals, hang watchdog and the timeouts
it keeps from measured times, failure reports, test-only fault injection.
"""
