"""The gate after the matrix (.ci/gate.py) fails wherever coverage was lost without a test failing: an environment
that wrote no results, a test id that moved from its recorded outcome (a pass that became a skip, a skip that became a
pass), a cell the README promises that no environment ran; the results it reads are what pytest saw (conftest.py);
and the tox plugin (toxfile.py) finds pyenv's interpreters where PATH lacks them."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
GATE = ROOT / ".ci" / "gate.py"

PATCHED_209 = {"lightning.pytorch": ["2.0.9", "patched"], "lightning.fabric": ["2.0.9", "patched"],
               "pytorch_lightning": ["2.6.6", "native"]}
OUTCOMES = {"tests/test_a.py::test_passes": "passed", "tests/test_a.py::test_skips": "skipped: no GPU",
            "tests/test_a.py::test_fails_as_expected": "xfailed: native fails it"}
CELL = {"releases": {"lightning": "2.0.9", "torch": "2.13"}, "python": "3.11", "mode": "patched"}


@pytest.fixture(scope="module")
def gate():
    spec = importlib.util.spec_from_file_location("gate", GATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Matrix:
    """A results folder, recorded outcomes and declared cells, as a tox run and a clean clone's record leave them."""

    def __init__(self, root: Path, gate):
        self.root, self.gate = root, gate
        self.results, self.outcomes, self.cells = root / "results", root / "outcomes", root / "cells.json"
        self.results.mkdir()
        self.cells.write_text(json.dumps([CELL]))

    def ran(self, env: str, outcomes=None, lightning=None, torch="2.13.0", python="3.11.9") -> None:
        record = {"python": python, "installed": {"lightning": "2.0.9", "pytorch-lightning": "2.6.6", "torch": torch},
                  "lightning": lightning or PATCHED_209, "deselected": 0, "outcomes": outcomes or OUTCOMES}
        (self.results / f"{env}.json").write_text(json.dumps(record))

    def record(self) -> int:
        return self.gate.record(self.results, self.outcomes)

    def check(self) -> int:
        return self.gate.check(self.results, self.outcomes, self.cells)


@pytest.fixture
def matrix(tmp_path, gate):
    return Matrix(tmp_path, gate)


def test_a_run_as_recorded_passes_and_prints_the_table(matrix, capsys):
    matrix.ran("alpha")
    assert matrix.record() == 0
    assert json.loads((matrix.outcomes / "alpha.json").read_text())["outcomes"] == OUTCOMES
    assert matrix.check() == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["alpha", "3.11.9"] and line.split()[-5:] == ["1", "1", "1", "0", "0"]
               for line in out.splitlines()), out


@pytest.mark.parametrize("test, outcome", [
    ("tests/test_a.py::test_passes", "skipped: no GPU"),  # a pass that became a skip
    ("tests/test_a.py::test_skips", "passed"),  # a skip that became a pass
    ("tests/test_a.py::test_skips", "skipped: another reason"),
    ("tests/test_a.py::test_fails_as_expected", "passed"),
])
def test_a_test_id_that_moved_fails_the_gate_naming_it_even_where_the_counts_are_unchanged(matrix, capsys, test, outcome):
    matrix.ran("alpha")
    matrix.record()
    swapped = {**OUTCOMES, test: outcome}
    if outcome == "passed" and test.endswith("test_skips"):  # the pass that became a skip beside it: counts unchanged
        swapped["tests/test_a.py::test_passes"] = "skipped: no GPU"
    matrix.ran("alpha", swapped)
    assert matrix.check() == 1
    assert f"  {test}: {OUTCOMES[test]} -> {outcome}" in capsys.readouterr().out


def test_a_test_no_longer_collected_fails_the_gate_and_a_new_one_may_pass_but_not_skip(matrix, capsys):
    matrix.ran("alpha")
    matrix.record()
    gone = {t: o for t, o in OUTCOMES.items() if not t.endswith("test_skips")}
    matrix.ran("alpha", {**gone, "tests/test_b.py::test_new": "passed"})
    assert matrix.check() == 1
    assert "  tests/test_a.py::test_skips: skipped: no GPU -> not collected" in capsys.readouterr().out
    matrix.ran("alpha", {**OUTCOMES, "tests/test_b.py::test_new": "passed"})
    assert matrix.check() == 0
    matrix.ran("alpha", {**OUTCOMES, "tests/test_b.py::test_new": "skipped: no GPU"})
    assert matrix.check() == 1
    assert "  tests/test_b.py::test_new: new, skipped: no GPU (record it)" in capsys.readouterr().out


def test_a_failure_fails_the_gate_and_cannot_be_recorded(matrix, capsys):
    matrix.ran("alpha", {**OUTCOMES, "tests/test_a.py::test_passes": "failed"})
    assert matrix.record() == 1 and not matrix.outcomes.exists()
    matrix.ran("alpha")
    matrix.record()
    matrix.ran("alpha", {**OUTCOMES, "tests/test_a.py::test_passes": "error"})
    assert matrix.check() == 1
    assert "alpha: 1 failed\n  tests/test_a.py::test_passes: error" in capsys.readouterr().out


def test_a_recorded_environment_that_wrote_no_results_fails_the_gate_and_so_does_an_unrecorded_one(matrix, capsys):
    """Left out of tox's env_list, its interpreter missing, or given a setenv without the results variable: no results."""
    matrix.ran("alpha")
    matrix.ran("beta")
    matrix.record()
    (matrix.results / "beta.json").unlink()
    matrix.ran("gamma")
    assert matrix.check() == 1
    out = capsys.readouterr().out
    assert "beta: wrote no results" in out and "gamma: no recorded outcomes" in out


def test_a_cell_no_environment_ran_fails_the_gate_whatever_else_was_dropped(matrix, capsys):
    """An environment dropped everywhere (env_list, its record): the cell the README promises still fails the gate."""
    matrix.ran("alpha", torch="2.4.1")
    matrix.record()
    assert matrix.check() == 1
    assert "cell not run by any environment: lightning 2.0.9 · torch 2.13 · Python 3.11 (patched)" in capsys.readouterr().out


@pytest.mark.parametrize("ran, covered", [
    ({}, True),
    ({"python": "3.12.1"}, False),
    ({"torch": "2.1.2"}, False),
    ({"torch": "2.13.1"}, True),
    # the shim took 2.0.9 for native: the cell promises it patched
    ({"lightning": {**PATCHED_209, "lightning.pytorch": ["2.0.9", "native"]}}, False),
])
def test_a_cell_is_covered_by_the_releases_an_environment_reports_and_the_shims_mode(matrix, gate, ran, covered):
    matrix.ran("alpha", **ran)
    results = json.loads((matrix.results / "alpha.json").read_text())
    assert gate.covers(results, CELL) is covered
    assert gate.covers(results, {**CELL, "releases": {"lightning": ">=2.0", "torch": "2"}}) is (covered or "torch" in ran)


def test_the_results_are_what_pytest_saw_each_test_id_with_its_reason(tmp_path):
    """conftest.py's record of a run: a pass, a skip and an expected failure with their reasons, a failure, and a test
    that passed but failed its teardown (an error)."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skips(): pass\n"
        "@pytest.mark.xfail(reason='native fails it', strict=True)\n"
        "def test_fails_as_expected(): assert False\n"
        "def test_fails(): assert False\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    yield\n"
        "    raise RuntimeError\n"
        "def test_errs_in_teardown(broken): pass\n"
    )
    results = tmp_path / "results" / "env.json"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q", "test_sample.py"],
                   cwd=tmp_path, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "tests"), "LIGHTNING_FSDP_RESUME_RESULTS": str(results)})
    record = json.loads(results.read_text())
    assert record["outcomes"] == {"test_sample.py::test_passes": "passed", "test_sample.py::test_skips": "skipped: no GPU",
                                  "test_sample.py::test_fails_as_expected": "xfailed: native fails it",
                                  "test_sample.py::test_fails": "failed", "test_sample.py::test_errs_in_teardown": "error"}
    from importlib import metadata

    assert record["installed"]["torch"] == metadata.version("torch") and record["python"] == ".".join(map(str, sys.version_info[:3]))


def test_the_tests_run_with_strict_expected_failures_and_declared_marks_only(request):
    """setup.cfg: an expected failure that passes fails (xfail_strict), and a misspelt mark is an error (--strict-markers)."""
    assert request.config.getini("xfail_strict") is True
    assert request.config.option.strict_markers is True


def test_the_tox_plugin_appends_pyenvs_interpreter_that_path_lacks(tmp_path, monkeypatch):
    """toxfile.py: a ``python3.N`` not on PATH is found in pyenv's versions, its folder appended after the rest."""
    sys.path.insert(0, str(ROOT))
    try:
        import toxfile
    finally:
        sys.path.remove(str(ROOT))
    for version in ("3.97.2", "3.97.10", "3.98.0"):
        bin_dir = tmp_path / "pyenv" / "versions" / version / "bin"
        bin_dir.mkdir(parents=True)
        executable = bin_dir / f"python{version.rsplit('.', 1)[0]}"
        executable.write_text("#!/bin/sh\nexit 0\n")
        executable.chmod(0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    path = toxfile.interpreter_path("/usr/bin:/bin", ["3.97", "3.96"])
    assert path == os.pathsep.join(["/usr/bin:/bin", str(tmp_path / "pyenv" / "versions" / "3.97.10" / "bin")])
    assert toxfile.interpreter_path(path, ["3.97"]) == path  # found on PATH now: nothing appended
