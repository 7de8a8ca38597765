"""The methods the patches put on Lightning's classes: the Trainer's and Fabric's FSDPStrategy, Lightning's own reads of
full checkpoints, ModelCheckpoint.
"""
