"""A checkpoint in the Trainer's format, small enough to write by hand, and the epoch read back from a saved one:
for the tests that save and load through the patched strategy in one process."""
from pathlib import Path

from lightning_fsdp_resume._checkpoint import _reader
from lightning_fsdp_resume._storage import checked, open_path


def trainer_checkpoint(epoch: int) -> dict:
    """What the Trainer hands ``save_checkpoint``: one layer's weights and its Adam-like state, named by parameter."""
    import torch

    weight, bias = torch.full((4, 3), float(epoch)), torch.arange(4.0)
    return {
        "epoch": epoch,
        "state_dict": {"layer.weight": weight, "layer.bias": bias},
        "optimizer_states": [
            {"state": {"layer.weight": {"exp_avg": weight * 2, "step": torch.tensor(float(epoch))}},
             "param_groups": [{"lr": 0.1, "params": ["layer.weight", "layer.bias"]}]}
        ],
    }


def saved_epoch(path: Path) -> int:
    """The ``epoch`` of a saved checkpoint: a sharded directory's ``meta.pt`` or a full file."""
    location = open_path(path, "load")
    return (_reader.meta(location) if location.is_dir() else checked.load_file(location))["epoch"]
