"""The strategy's save and load in one process with no process group (a notebook, a unit test), as native
Lightning 2.1 allows: Lightning 2.0.x's ``broadcast`` and ``barrier`` fail there, the shim skips them."""
import pytest

from support.checkpoints import saved_epoch, trainer_checkpoint
from support.flavours import PATCHABLE_TRAINERS, strategy_class
from support.marks import needs_patched_trainer

pytestmark = needs_patched_trainer


@pytest.fixture
def no_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left a process group behind"


def _strategy_with_model(kind: str):
    """A strategy holding a plain LightningModule, attached to a Trainer that is not running."""
    import importlib

    import torch

    lightning = importlib.import_module(PATCHABLE_TRAINERS[0])

    class Layer(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 4)

    module = Layer()
    module.trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False)
    strategy = strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind)
    strategy._lightning_module = module
    strategy.model = module
    return strategy, module


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_save_and_load_need_no_process_group(tmp_path, no_process_group, kind):
    import torch

    path = tmp_path / "one-process.ckpt"
    strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind).save_checkpoint(trainer_checkpoint(3), path)
    assert saved_epoch(path) == 3 and path.is_dir() == (kind == "sharded")
    strategy, module = _strategy_with_model(kind)
    loaded = strategy.load_checkpoint(path)
    assert loaded["epoch"] == 3
    expected = trainer_checkpoint(3)["state_dict"]
    assert torch.equal(module.layer.weight, expected["layer.weight"]) and torch.equal(module.layer.bias, expected["layer.bias"])


def test_a_missing_path_is_a_file_not_found_and_a_value_error(tmp_path, no_process_group):
    """``FileNotFoundError`` says what happened; native 2.1 raises ``ValueError`` ("does not point to a valid
    checkpoint"), and code written against native catches that."""
    strategy, _ = _strategy_with_model("full")
    for expected in (FileNotFoundError, ValueError):
        with pytest.raises(expected, match=r"The path '.*nowhere\.ckpt' does not point to a valid checkpoint: it does not exist"):
            strategy.load_checkpoint(tmp_path / "nowhere.ckpt")
