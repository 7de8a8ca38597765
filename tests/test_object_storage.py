"""A checkpoint path that is a URL (s3://, gs://, memory://, any fsspec protocol) is refused by name before
anything is written or read: ``pathlib.Path`` would make it a local folder named after the scheme, and the
checkpoints would land on the node's disk instead of the bucket."""
import os
from pathlib import Path

import pytest

from support.flavours import PATCHABLE_FABRICS, PATCHABLE_TRAINERS, strategy_class
from support.marks import needs_cpu_fsdp, needs_patched_trainer

URL = "memory://bucket/run/epoch=0.ckpt"
REFUSAL = r"the checkpoint 'memory://bucket/run/epoch=0\.ckpt'.*not at URLs\. Nothing was written"


@pytest.fixture
def in_empty_directory(tmp_path, monkeypatch):
    """The working directory, where a URL taken for a local path would have been written."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert list(tmp_path.iterdir()) == [], "something was written to the working directory"


@needs_patched_trainer
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_the_trainers_save_and_load_refuse_a_url(in_empty_directory, kind):
    from support.checkpoints import trainer_checkpoint

    strategy = strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind)
    with pytest.raises(NotImplementedError, match="Cannot save " + REFUSAL):
        strategy.save_checkpoint(trainer_checkpoint(0), URL)
    with pytest.raises(NotImplementedError, match="Cannot load " + REFUSAL):
        strategy.load_checkpoint(URL)


@pytest.mark.skipif(not PATCHABLE_FABRICS, reason="no patched Fabric installed")
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fabrics_save_and_load_refuse_a_url(in_empty_directory, kind):
    import torch

    strategy = strategy_class(PATCHABLE_FABRICS[0])(state_dict_type=kind)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="Cannot save " + REFUSAL):
        strategy.save_checkpoint(URL, {"model": model})
    with pytest.raises(NotImplementedError, match="Cannot load " + REFUSAL):
        strategy.load_checkpoint(URL, {"model": model})


def test_consolidate_refuses_a_url(in_empty_directory, capsys):
    from lightning_fsdp_resume.cli import main

    assert main(["consolidate", URL, "out.ckpt"]) == 1
    assert "Cannot read the checkpoint 'memory://bucket/run/epoch=0.ckpt'" in capsys.readouterr().err
    assert main(["consolidate", str(in_empty_directory / "missing"), "s3://bucket/out.ckpt"]) == 1
    assert "Cannot write the checkpoint 's3://bucket/out.ckpt'" in capsys.readouterr().err


@needs_cpu_fsdp
@needs_patched_trainer
def test_a_model_checkpoint_dirpath_url_stops_the_run_and_writes_nothing_locally(in_empty_directory, process_group):
    """The way users meet it: ``ModelCheckpoint(dirpath="memory://…")`` with FSDP; the first save refuses."""
    import importlib

    from lightning_fsdp_resume.testing import enable_cpu_fsdp
    from support.trainer_worker import Net, data

    lightning = importlib.import_module(PATCHABLE_TRAINERS[0])
    callbacks = importlib.import_module(f"{PATCHABLE_TRAINERS[0]}.callbacks")
    enable_cpu_fsdp()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, strategy=strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type="sharded"),
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callbacks.ModelCheckpoint(dirpath="memory://bucket/run", filename="{epoch}")],
    )
    with pytest.raises(NotImplementedError, match=r"Cannot save the checkpoint 'memory://bucket/run/epoch=0\.ckpt'"):
        trainer.fit(Net(), train_dataloaders=data())
    assert not Path("memory:").exists() and os.listdir(".") == []
