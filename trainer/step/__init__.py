"""One optimizer step: the local step, the pipelined steps (torch's schedules, PipeDream-2BW), the
loss and the validation pass.
"""
