"""``testing.enable_cpu_fsdp()`` lifts Fabric's GPU-only check for FSDP, in both of Fabric's namespaces, and
``disable_cpu_fsdp()`` puts it back. (The Trainer's is lifted for every Trainer test of FSDP on the CPU.)"""
import importlib

import pytest

from lightning_fsdp_resume.testing import disable_cpu_fsdp, enable_cpu_fsdp

# Fabric's own words, from 2.0.0 to 2.6
FABRIC_GPU_ONLY = r"You selected the FSDP strategy but FSDP is only available on GPU"


@pytest.mark.parametrize("package", ["lightning.fabric", "lightning_fabric"])
def test_fabric_chooses_fsdp_on_cpu_until_disabled(package):
    fabric = pytest.importorskip(package)
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
