"""What each step of a run trains on, as arithmetic over the steps: the batch-size ramp and
sequence-length warm-up (`ramps`), and the mixture's shares and exact counts (`mixture`).
"""
