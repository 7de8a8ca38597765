import json
import os
import sys
from pathlib import Path

# The tests import their helpers from the support package (tests/support).
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

RESULTS_ENV = "LIGHTNING_FSDP_RESUME_RESULTS"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted 2-rank runs, one per configuration, made on first use and shared by the tests."""
    from support.ranks import EPOCHS, config, worker

    runs = {}

    def get(state_dict_type: str, use_orig_params: int, optimizers: int = 1, wrap: str = "policy") -> Path:
        key = (state_dict_type, use_orig_params, optimizers, wrap)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"ref-{state_dict_type}-{use_orig_params}-{optimizers}-{wrap}")
            worker(root, *config(root, *key), "--max-epochs", EPOCHS)
            runs[key] = root
        return runs[key]

    return get


@pytest.fixture(scope="session")
def fabric_reference(tmp_path_factory):
    """Uninterrupted 2-rank Fabric runs, one per ``state_dict_type``, made on first use and shared by the tests."""
    from support.ranks import EPOCHS, fabric_config, fabric_worker

    runs = {}

    def get(state_dict_type: str) -> Path:
        if state_dict_type not in runs:
            root = tmp_path_factory.mktemp(f"fabric-ref-{state_dict_type}")
            fabric_worker(root, *fabric_config(root, state_dict_type), "--epochs", EPOCHS)
            runs[state_dict_type] = root
        return runs[state_dict_type]

    return get


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """One rank over gloo, in this process, for a test module: torch.distributed.checkpoint wants a process
    group on torch < 2.2, FSDP always."""
    import torch.distributed as dist

    from lightning_fsdp_resume.testing import leave_process_group

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    # as a rank program ends: modules that used the group (DDP, FSDP) and live on in reference cycles go first,
    # and the group waits for gloo's threads (a destroy right after the module's last collective could hang)
    leave_process_group()


def pytest_collection_modifyitems(items):
    """Every test that uses the S3 server is marked ``s3``: tox leaves them out where only Python or wrapt differs."""
    for item in items:
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server on 127.0.0.1 (support/s3.py), for the session; this process's fsspec is
    configured for it, as a user configures theirs. Needs the test extra: moto[server], s3fs, boto3, flask. Where tox
    installs them, one that does not import fails the tests instead of skipping them (support/marks.py)."""
    from support.marks import S3_PACKAGES, require

    require("s3", *S3_PACKAGES)
    import fsspec.config

    from support.s3 import S3Server

    server = S3Server(str(tmp_path_factory.mktemp("s3") / "server.log"))
    saved = dict(fsspec.config.conf)
    fsspec.config.conf.update(server.fsspec_conf())
    yield server
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved)
    server.stop()


@pytest.fixture
def bucket(s3_server, request):
    """A new, empty bucket of the S3 server: its URL."""
    import re

    name = re.sub(r"[^a-z0-9-]", "-", f"t{len(s3_server.buckets)}-{request.node.name.lower()}")[:63].strip("-")
    s3_server.create_bucket(name)
    return f"s3://{name}"


# The distributions whose releases make a cell of the matrix (.ci/cells.json), read from what is installed
CELL_DISTRIBUTIONS = ("lightning", "pytorch-lightning", "lightning-fabric", "torch", "wrapt")
# pytest's categories, in the order in which a later one overrides an earlier one for a test id (a test that passed
# and then failed in its teardown is an error)
OUTCOMES = ("passed", "skipped", "xfailed", "xpassed", "failed", "error")


def _outcome(category: str, report) -> str:
    """A test's outcome as the gate compares it: its category, with the reason of a skip or an expected failure."""
    if category == "skipped":
        reason = str(report.longrepr[2])
        return "skipped: " + (reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason)
    if category == "xfailed":
        return f"xfailed: {report.wasxfail}"
    return category


def pytest_terminal_summary(terminalreporter):
    """Where tox asks for it, write this run's releases, the shim's modes and every test id's outcome, for the gate
    (.ci/gate.py)."""
    target = os.environ.get(RESULTS_ENV)
    if not target:
        return
    import platform
    from importlib import metadata

    import lightning_fsdp_resume as shim
    from lightning_fsdp_resume._patching._versions import import_installed_flavours

    import_installed_flavours()  # so that status() reports what a training script would get
    installed = {}
    for distribution in CELL_DISTRIBUTIONS:
        try:
            installed[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    outcomes = {}
    for category in OUTCOMES:
        for report in terminalreporter.stats.get(category, []):
            outcomes[report.nodeid] = _outcome(category, report)
    record = {
        "python": platform.python_version(),
        "installed": installed,
        "lightning": {p: [s.version, s.mode] for p, s in shim.status().items() if s.version},
        "deselected": len(terminalreporter.stats.get("deselected", [])),
        "outcomes": outcomes,
    }
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(record, indent=1, sort_keys=True))
