"""Saving and loading FSDP's sharded state: what ranks agree on, the flat shards read into and saved from as views, the
save (in the background too) and the load routine both strategies share.
"""
