"""The matrix table that ends a tox run (.ci/matrix_summary.py) fails the matrix wherever coverage was lost without a
test failing: an environment that did not run (its interpreter missing), and one that passed fewer tests, expected
fewer failures or skipped more than .ci/expected.json says; and the tox plugin (toxfile.py) finds pyenv's interpreters
where PATH lacks them."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SUMMARY = ROOT / ".ci" / "matrix_summary.py"


@pytest.fixture
def summary():
    spec = importlib.util.spec_from_file_location("matrix_summary", SUMMARY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _matrix(tmp_path: Path, envs, expected) -> Path:
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "expected.json").write_text(json.dumps(expected))
    setenv = "LIGHTNING_FSDP_RESUME_RESULTS = {toxworkdir}/results/{envname}.json"
    (tmp_path / "tox.ini").write_text(f"[tox]\nenvlist =\n    {chr(10).join('    ' + e for e in envs).strip()}\n"
                                      f"[testenv]\nsetenv =\n    {setenv}\n")
    (tmp_path / "results").mkdir()
    return tmp_path


def _results(matrix: Path, env: str, **counts) -> None:
    record = {"torch": "2.13.0", "lightning": {"lightning.pytorch": ["2.0.9", "patched"]}, "passed": 10, "skipped": 1,
              "failed": 0, "error": 0, "deselected": 0, "xfailed": 2, "skip_reasons": {"no GPU": 1},
              "xfail_reasons": {"native fails it": 2}, **counts}
    (matrix / "results" / f"{env}.json").write_text(json.dumps(record))


def test_a_matrix_that_ran_what_it_expects_passes_and_lists_every_reason(summary, tmp_path, capsys):
    matrix = _matrix(tmp_path, ["alpha"], {"alpha": {"passed": 10, "skipped": 1, "xfailed": 2}})
    _results(matrix, "alpha")
    assert summary(matrix / "results", matrix / "tox.ini") == 0
    out = capsys.readouterr().out
    assert "alpha: 1 skipped: no GPU" in out and "alpha: 2 expected to fail: native fails it" in out


@pytest.mark.parametrize("counts, shortfall", [
    ({"passed": 9, "skipped": 2}, "alpha: passed 9 < 10; skipped 2 > 1"),
    ({"xfailed": 1}, "alpha: xfailed 1 < 2"),
])
def test_fewer_tests_run_than_expected_fail_the_matrix_naming_the_environment(summary, tmp_path, capsys, counts, shortfall):
    matrix = _matrix(tmp_path, ["alpha"], {"alpha": {"passed": 10, "skipped": 1, "xfailed": 2}})
    _results(matrix, "alpha", **counts)
    assert summary(matrix / "results", matrix / "tox.ini") == 1
    assert shortfall in capsys.readouterr().out


def test_an_environment_whose_interpreter_is_missing_fails_the_matrix_naming_it(summary, tmp_path, capsys):
    matrix = _matrix(tmp_path, ["alpha", "py31-alpha"], {"alpha": {"passed": 10}})
    _results(matrix, "alpha")
    assert summary(matrix / "results", matrix / "tox.ini") == 1
    assert any(line.startswith("py31-alpha") and "NOT RUN: no python3.1 on PATH" in line
               for line in capsys.readouterr().out.splitlines())



def test_the_expected_counts_name_every_environment_of_the_matrix():
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "tox.ini")
    reporting = [e for e in config["tox"]["envlist"].split() if e not in ("lint", "summary")]
    assert sorted(json.loads((ROOT / ".ci" / "expected.json").read_text())) == sorted(reporting)


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
