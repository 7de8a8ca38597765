"""Fabric's patched classes in one process: signatures, argument checks, native errors, and the strategies
the new arguments do not reach. The multi-rank behaviour is in test_fabric_multirank.py."""
import importlib
import inspect

import pytest
import torch

from support.flavours import PATCHABLE_FABRICS
from support.marks import TORCH, needs_patched_fabric

pytestmark = needs_patched_fabric
PACKAGE = PATCHABLE_FABRICS[0] if PATCHABLE_FABRICS else None


def _fabric_module(name: str):
    return importlib.import_module(f"{PACKAGE}.{name}")


@pytest.fixture
def fabric():
    """A one-device Fabric on the CPU: its strategy is not FSDP."""
    return _fabric_module("fabric").Fabric(accelerator="cpu", devices=1)


@pytest.mark.parametrize("package", PATCHABLE_FABRICS)
def test_signatures_list_the_new_arguments(package):
    fabric = importlib.import_module(f"{package}.fabric").Fabric
    strategy = importlib.import_module(f"{package}.strategies.fsdp").FSDPStrategy
    assert inspect.signature(fabric.save).parameters["filter"].default is None
    assert inspect.signature(fabric.load).parameters["strict"].default is True
    assert list(inspect.signature(fabric.load_raw).parameters) == ["self", "path", "obj", "strict", "weights_only"]
    for method in (fabric.load, fabric.load_raw, strategy.load_checkpoint):
        parameter = inspect.signature(method).parameters["weights_only"]
        assert parameter.default is None
    assert inspect.signature(fabric.load).parameters["weights_only"].kind == inspect.Parameter.KEYWORD_ONLY
    parameter = inspect.signature(strategy).parameters["state_dict_type"]
    assert (parameter.default, parameter.kind) == ("sharded", inspect.Parameter.KEYWORD_ONLY)
    assert strategy()._state_dict_type == "sharded" and strategy(state_dict_type="full")._state_dict_type == "full"
    parameter = inspect.signature(strategy).parameters["async_save"]
    assert (parameter.default, parameter.kind) == (False, inspect.Parameter.KEYWORD_ONLY)
    assert strategy()._async_save is False and strategy(async_save=True)._async_save is True


def test_filter_is_checked_as_native_checks_it(fabric, tmp_path):
    state = {"model": torch.nn.Linear(2, 2)}
    with pytest.raises(TypeError, match="Filter should be a dictionary, given"):
        fabric.save(tmp_path / "x.ckpt", state, filter=lambda k, v: True)
    with pytest.raises(ValueError, match=r"The filter keys \{'other'\} are not present in the state keys"):
        fabric.save(tmp_path / "x.ckpt", state, filter={"other": lambda k, v: True})
    with pytest.raises(TypeError, match=r"Expected `fabric.save\(filter=...\)` for key 'model' to be a callable"):
        fabric.save(tmp_path / "x.ckpt", state, filter={"model": 1})
    assert not list(tmp_path.iterdir())


def test_other_strategies_keep_2_0_behaviour_and_refuse_the_new_arguments(fabric, tmp_path):
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "single.ckpt"
    fabric.save(path, {"model": model, "step": 3})
    state = {"model": torch.nn.Linear(2, 2)}
    remainder = fabric.load(path, state)
    assert torch.equal(state["model"].weight, model.weight) and remainder == {"step": 3}
    with pytest.raises(NotImplementedError, match=r"fabric.save\(..., filter=...\)` needs Lightning 2.1.*SingleDeviceStrategy"):
        fabric.save(path, {"model": model}, filter={"model": lambda k, v: True})
    with pytest.raises(NotImplementedError, match=r"fabric.load\(..., strict=False\)` needs Lightning 2.1"):
        fabric.load(path, {"model": model}, strict=False)
    with pytest.raises(NotImplementedError, match=r"fabric.load\(..., weights_only=...\)` needs Lightning 2.1"):
        fabric.load(path, {"model": model}, weights_only=True)


def test_load_raw_with_another_strategy_loads_the_state_dict(fabric, tmp_path):
    saved = torch.nn.Linear(3, 2)
    torch.save(saved.state_dict(), tmp_path / "raw.pt")
    model = fabric.setup_module(torch.nn.Linear(3, 2))
    fabric.load_raw(tmp_path / "raw.pt", model)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)


@pytest.mark.skipif(TORCH < (2, 2), reason=(
    "torch < 2.2: destroying a gloo process group that served DDP in the test process hung once in CI (torch 2.1.2);"
    " the unwrapping is the same on every torch"))
def test_load_raw_with_ddp_loads_the_modules_own_state_dict(tmp_path, process_group):
    """DDP's wrapper adds ``module.`` to every name; a raw state dict is the module's own, read by the strategy's
    CheckpointIO."""
    saved = torch.nn.Linear(3, 2)
    torch.save(saved.state_dict(), tmp_path / "raw.pt")
    fabric = _fabric_module("fabric").Fabric(accelerator="cpu", devices=1, strategy="ddp")
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(3, 2))
    fabric.load_raw(tmp_path / "raw.pt", model)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    del fabric, model  # before the process group goes (the fixture collects what cycles keep)


@pytest.mark.parametrize("kind", ["sharded meta.pt", "full file"])
def test_a_value_it_does_not_admit_is_refused_by_default_and_read_when_trusted(tmp_path, kind):
    """The checks read ``meta.pt`` and a full file as the load does (``weights_only`` decides ``trusted``)."""
    from fractions import Fraction

    from lightning_fsdp_resume import UnsafeCheckpointError
    from lightning_fsdp_resume._checkpoint import _reader
    from lightning_fsdp_resume._storage import open_path

    checkpoint = {"model": {"w": torch.ones(2)}, "ratio": Fraction(1, 3)}  # a value the restricted unpickler refuses
    if kind == "full file":
        torch.save(checkpoint, tmp_path / "c.ckpt")
        read = lambda trusted: _reader.full(open_path(tmp_path / "c.ckpt", "load", trusted), None)  # noqa: E731
    else:
        torch.save(checkpoint, tmp_path / "meta.pt")
        read = lambda trusted: _reader.meta(open_path(tmp_path, "load", trusted))  # noqa: E731
    with pytest.raises(UnsafeCheckpointError, match=r"names `fractions\.Fraction`.*load it with `weights_only=False`"):
        read(False)
    assert read(True)["ratio"] == Fraction(1, 3)


def test_not_strict_advice_names_fabrics_argument(tmp_path):
    from lightning_fsdp_resume._checkpoint import _preflight

    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: b\.\nPass `strict=False` to load the keys both have\.$"):
        _preflight.loadable_keys(tmp_path, {"a": (1,), "b": (2,)}, {"a": (1,)}, strict=True, leniency=_preflight.FABRIC_LENIENCY)


class TestStrategyRefusals:
    """The native errors that need no FSDP module, raised by the strategy itself in one process."""

    @pytest.fixture
    def strategy(self):
        return _fabric_module("strategies.fsdp").FSDPStrategy()

    def test_a_state_without_an_fsdp_module_is_refused(self, strategy, tmp_path):
        with pytest.raises(ValueError, match=r"^Could not find a FSDP model in the provided checkpoint state.*x\.ckpt"):
            strategy.save_checkpoint(tmp_path / "x.ckpt", {"model": torch.nn.Linear(2, 2)})
        assert not list(tmp_path.iterdir())

    def test_storage_options_and_sharded_filters_are_refused(self, strategy, tmp_path):
        with pytest.raises(TypeError, match="storage_options"):
            strategy.save_checkpoint(tmp_path / "x.ckpt", {}, storage_options={"a": 1})
        with pytest.raises(NotImplementedError, match="^FSDP doesn't support loading sharded filtered checkpoints"):
            strategy.save_checkpoint(tmp_path / "x.ckpt", {}, filter={"model": lambda k, v: True})

    def test_an_empty_state_and_an_optimizer_alone_are_refused(self, strategy, tmp_path):
        with pytest.raises(ValueError, match=r"^Got FSDPStrategy.load_checkpoint\(..., state=\{\}\) but a state with at least"):
            strategy.load_checkpoint(tmp_path / "x.ckpt", {})
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        with pytest.raises(NotImplementedError, match="^Loading a single optimizer object from a checkpoint is not supported"):
            strategy.load_checkpoint(tmp_path / "x.ckpt", optimizer)

    def test_load_raw_of_a_missing_path_says_so_in_natives_words(self, strategy, tmp_path):
        words = "Failed to load checkpoint directly into the model. The given path must be a single file containing the full state dict"
        with pytest.raises(FileNotFoundError, match=rf"^{words}: .*nowhere\. It does not exist\.$"):
            strategy.load_checkpoint(tmp_path / "nowhere", torch.nn.Linear(2, 2))

    def test_a_missing_model_entry_is_refused_even_when_not_strict_and_says_why(self, tmp_path):
        torch.save({"net": {}, "step": 1}, tmp_path / "other.ckpt")
        with pytest.raises(KeyError, match=r"a key 'model' that does not exist.*needed even with `strict=False`"):
            _check(tmp_path / "other.ckpt", "model", ["step"], strict=False)
        with pytest.raises(KeyError, match=r"a key 'model' that does not exist.* To disable strict loading, set `strict=False`"):
            _check(tmp_path / "other.ckpt", "model", ["step"], strict=True)

    def test_not_strict_says_which_requested_entries_the_checkpoint_lacks(self, tmp_path):
        torch.save({"model": {}, "step": 1}, tmp_path / "c.ckpt")
        with pytest.warns(UserWarning, match=r"strict=False\): the checkpoint .*c\.ckpt' holds no 'optimizer', 'ema'; left as they are"):
            kind, entries = _check(tmp_path / "c.ckpt", "model", ["optimizer", "ema", "step"], strict=False)
        assert (kind, entries) == ("full", {"model", "step"})


def _check(path, module_key, requested, strict):
    """Rank 0's check of ``fabric.load(path, state)`` for a state of ``module_key`` and the ``requested`` entries."""
    from lightning_fsdp_resume._lightning import _fabric
    from lightning_fsdp_resume._storage import open_path

    state = {key: None for key in requested}  # plain values: none is an optimizer or a module
    request = _fabric._FabricLoad(state, module_key, None, strict, weights_only=False)
    return request.check(open_path(path, "load"))
