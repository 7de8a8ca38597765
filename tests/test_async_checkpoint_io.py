"""Lightning's ``AsyncCheckpointIO`` with FSDP in one process: every checkpoint is complete when it is published.

Its own thread wrote a full checkpoint's file after the shim had published the partial one (and ModelCheckpoint had
removed the checkpoint it replaced). FSDP saves run in the shim's background instead (test_async_saves.py, with
ranks), or in the foreground with one warning where torch cannot.
"""
import contextlib
import importlib

import pytest

from support.flavours import PATCHABLE_TRAINERS, strategy_class
from support.marks import needs_cpu_fsdp, needs_patched_trainer

pytestmark = [needs_cpu_fsdp, needs_patched_trainer]


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_saves_with_async_checkpoint_io_are_complete_when_published(tmp_path, process_group, kind):
    import torch

    from lightning_fsdp_resume._lightning._lightning_reads import read_whole
    from lightning_fsdp_resume._storage import open_path
    from lightning_fsdp_resume.testing import enable_cpu_fsdp
    from support.states import full_weights
    from support.trainer_worker import Net, data

    lightning = importlib.import_module(PATCHABLE_TRAINERS[0])
    callbacks = importlib.import_module(f"{PATCHABLE_TRAINERS[0]}.callbacks")
    plugins = importlib.import_module(f"{PATCHABLE_TRAINERS[0]}.plugins.io")
    enable_cpu_fsdp()
    trained = Net()

    class Snapshot(lightning.Callback):
        """The weights at each epoch's end, where its checkpoint is saved."""

        weights = {}

        def on_train_epoch_end(self, trainer, pl_module):
            self.weights[trainer.current_epoch] = full_weights(trainer.strategy.model, pl_module)

    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, strategy=strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind), max_epochs=3,
        logger=False, enable_progress_bar=False, enable_model_summary=False, plugins=[plugins.AsyncCheckpointIO()],
        callbacks=[callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=1, monitor="step", mode="max"),
                   Snapshot()],
    )
    from lightning_fsdp_resume._patching import _torch_compat as compat

    foreground = pytest.warns(UserWarning, match="FSDP checkpoints are saved in the foreground: saving them in the background")
    with contextlib.nullcontext() if compat.saves_in_background() else foreground:
        trainer.fit(trained, train_dataloaders=data())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=2.ckpt"]
    # the sharded one through the shim's reader; the full file as it is (Lightning 2.0.x's own reader of full files
    # trips over torch >= 2.6's weights_only default, docs/safety.md)
    checkpoint = tmp_path / "epoch=2.ckpt"
    loaded = read_whole(open_path(checkpoint, "load")) if kind == "sharded" else torch.load(checkpoint, weights_only=False)
    loaded = loaded["state_dict"]
    assert sorted(loaded) == sorted(Snapshot.weights[2])
    for name, value in Snapshot.weights[2].items():
        assert torch.equal(loaded[name], value), name
