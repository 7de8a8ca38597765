"""What the command line runs on a checkpoint: consolidate (a sharded checkpoint into one full file) and verify.
"""
