"""A run's place beyond its weights: every rank's random states and rank-local buffers, where it is in its data (the
data cursor on any number of ranks), and Lightning's training epoch loop resumed there.
"""
