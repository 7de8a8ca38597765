"""Patching: which Lightning and torch releases are installed and what to do with each, the reversible patcher, the
tables of what is patched where, what the package keeps on objects it does not own, and every difference between
torch releases.
"""
