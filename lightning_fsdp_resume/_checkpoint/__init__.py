"""A checkpoint's format: its entries and keys, the checksums of its bytes and a full file's zip records, the restricted
unpickler, and the one reader of its parts with the checks made before a load.
"""
