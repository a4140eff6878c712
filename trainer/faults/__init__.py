"""What goes wrong in a long run: step guards and stop signals, hang watchdog, failure reports,
test-only fault injection.
"""
