"""``testing.enable_cpu_fsdp()`` lifts Fabric's GPU-only check for FSDP, in both of Fabric's namespaces, and
``disable_cpu_fsdp()`` puts it back (the Trainer's is lifted for every Trainer test of FSDP on the CPU);
``cpu_optimizer_state_supported()`` says what this torch can gather."""
import importlib

import pytest

from lightning_fsdp_resume.testing import cpu_optimizer_state_supported, disable_cpu_fsdp, enable_cpu_fsdp
from support.flavours import INSTALLED, optimizer_state_on_cpu

# Fabric's own words, from 2.0.0 to 2.6
FABRIC_GPU_ONLY = r"You selected the FSDP strategy but FSDP is only available on GPU"


@pytest.mark.parametrize("package", [
    pytest.param(package, marks=pytest.mark.skipif(package not in INSTALLED, reason=f"{package} is not installed"))
    for package in ("lightning.fabric", "lightning_fabric")
])
def test_fabric_chooses_fsdp_on_cpu_until_disabled(package):
    fabric = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")

    def cpu_fsdp_fabric():
        return fabric.Fabric(accelerator="cpu", devices=1, strategy=strategies.FSDPStrategy())

    with pytest.raises(ValueError, match=FABRIC_GPU_ONLY):
        cpu_fsdp_fabric()
    enable_cpu_fsdp()
    try:
        assert type(cpu_fsdp_fabric().strategy) is strategies.FSDPStrategy
    finally:
        disable_cpu_fsdp()
    with pytest.raises(ValueError, match=FABRIC_GPU_ONLY):
        cpu_fsdp_fabric()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_the_optimizer_state_helper_says_what_this_torch_release_can_gather(use_orig_params):
    """``testing.cpu_optimizer_state_supported`` (public, for users' own CPU tests) agrees with the tests' reading of
    the torch release, which decides their skips; where it says no, it names the release."""
    supported, why = cpu_optimizer_state_supported(use_orig_params)
    assert supported is optimizer_state_on_cpu(use_orig_params)
    assert why == "" if supported else why.startswith("torch 2.2 gathers optimizer state with use_orig_params=True")
