"""Configuring the strategy the way LightningCLI users do: a YAML config or flags reach ``state_dict_type``.

jsonargparse reads the patched ``__init__``'s signature to learn what ``FSDPStrategy`` accepts; before the
signature listed ``state_dict_type`` it refused the key ("Key 'state_dict_type' is not expected").
"""
import importlib
import inspect
import os

import pytest
import torch

from lightning_fsdp_resume.testing import disable_cpu_fsdp, enable_cpu_fsdp
from support.flavours import PACKAGE, PATCHABLE_TRAINERS, TRAINERS, strategy_class
from support.marks import needs_cpu_fsdp, needs_patched_trainer
from support.ranks import EPOCHS, MID, worker
from support.states import assert_ranks_identical, load


@pytest.fixture(scope="module", autouse=True)
def cpu_fsdp():
    enable_cpu_fsdp()  # the Trainer refuses FSDP without a GPU; lifted here as in every test of FSDP on the CPU
    yield
    disable_cpu_fsdp()


def _config(path, package: str, state_dict_type: str, **trainer) -> str:
    lines = ["trainer:", "  strategy:", f"    class_path: {package}.strategies.FSDPStrategy", "    init_args:",
             f"      state_dict_type: {state_dict_type}"]
    lines += [f"  {key}: {value}" for key, value in trainer.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _parsed_strategy(package: str, args):
    """The strategy of the Trainer LightningCLI builds from ``args``, without running anything."""
    cli = importlib.import_module(f"{package}.cli")
    lightning = importlib.import_module(package)

    class Tiny(lightning.LightningModule):  # pytorch_lightning 2.0.9's demos import requests, not a dependency
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    model = Tiny
    common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    return cli.LightningCLI(model, run=False, args=[*args, *common], save_config_callback=None).trainer.strategy


@pytest.mark.parametrize("package", TRAINERS)
@pytest.mark.parametrize("form", ["yaml", "flags"])
def test_lightning_cli_passes_state_dict_type_to_the_strategy(tmp_path, package, form):
    if form == "yaml":
        args = ["--config", _config(tmp_path / "config.yaml", package, "sharded")]
    else:
        args = ["--trainer.strategy=FSDPStrategy", "--trainer.strategy.state_dict_type=sharded"]
    strategy = _parsed_strategy(package, args)
    assert type(strategy) is strategy_class(package)
    assert strategy._state_dict_type == "sharded"


@pytest.mark.parametrize("package", TRAINERS)
def test_lightning_cli_refuses_an_unknown_state_dict_type_naming_the_choices(tmp_path, package, capsys):
    with pytest.raises(SystemExit):
        _parsed_strategy(package, ["--trainer.strategy=FSDPStrategy", "--trainer.strategy.state_dict_type=shard"])
    error = capsys.readouterr().err
    assert "state_dict_type" in error and "sharded" in error and "full" in error, error[-2000:]


@pytest.mark.parametrize("package", TRAINERS)
def test_registry_names_give_the_strategy_with_its_default(package):
    trainer = importlib.import_module(package).Trainer(strategy="fsdp", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is strategy_class(package)
    assert trainer.strategy._state_dict_type == "full"


@needs_patched_trainer
@pytest.mark.parametrize("package", PATCHABLE_TRAINERS)
def test_the_patched_signature_lists_state_dict_type_and_keeps_the_rest(package):
    import lightning_fsdp_resume as shim

    cls = strategy_class(package)
    patched = inspect.signature(cls)
    parameter = patched.parameters["state_dict_type"]
    assert (parameter.default, parameter.kind) == ("full", inspect.Parameter.KEYWORD_ONLY)
    assert list(patched.parameters)[-1] == "kwargs"
    shim.unpatch()
    try:
        original = inspect.signature(cls)
    finally:
        shim.patch()
    assert "state_dict_type" not in original.parameters
    assert [p for p in patched.parameters.values() if p.name != "state_dict_type"] == list(original.parameters.values())


@pytest.mark.multirank
@needs_cpu_fsdp
def test_a_lightning_cli_fit_saves_sharded_and_resumes_bit_exact(tmp_path):
    """``fit --config`` on 2 ranks writes sharded checkpoints; ``fit --config --ckpt_path`` in new processes
    restores and ends with every rank's shards and optimizer state of the uninterrupted run."""
    trainer = {"accelerator": "cpu", "devices": 2, "max_epochs": EPOCHS, "logger": "false",
               "enable_progress_bar": "false", "enable_model_summary": "false", "limit_val_batches": 0,
               "deterministic": "true"}
    config = _config(tmp_path / "config.yaml", PACKAGE, "sharded", **trainer)
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    worker(ref, "cli", "--out", ref / "out", "--ckpt-dir", ref / "ckpt", "fit", "--config", config)
    checkpoint = ref / "ckpt" / MID
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file() and (checkpoint / ".metadata").is_file()
    assert load(checkpoint / "meta.pt")["epoch"] == 1
    worker(resumed, "cli", "--out", resumed / "out", "--ckpt-dir", resumed / "ckpt", "fit", "--config", config,
           "--ckpt_path", checkpoint)
    assert_ranks_identical(ref / "out", "epoch1", resumed / "out", "start")
    assert_ranks_identical(ref / "out", "final", resumed / "out", "final")
    assert sorted(os.listdir(resumed / "ckpt")) == [f"epoch={e}.ckpt" for e in range(2, EPOCHS)]
