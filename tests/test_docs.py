"""The documents tell the truth about the repository: CONTRIBUTING.md's matrix table is the tox matrix, the
README opens with the commands CI runs and stays one page whose table leads to docs/, and every relative link leads
to a file and heading that exist."""
import configparser
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCUMENTS = ["README.md", "CONTRIBUTING.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _tox():
    config = configparser.ConfigParser()
    config.read(ROOT / "tox.ini")
    return config


def _matrix_environments():
    """The first column of CONTRIBUTING.md's matrix table."""
    return re.findall(r"^\| `([a-z0-9-]+)` \|", (ROOT / "CONTRIBUTING.md").read_text(), flags=re.M)


def _without_code_blocks(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _prose(text):
    """A Markdown document's prose: its code blocks and its tables' rows left out."""
    return "\n".join(line for line in _without_code_blocks(text).splitlines() if not line.lstrip().startswith("|"))


def _anchors(path):
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", _without_code_blocks(path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_matrix_table_lists_exactly_the_environments_tox_runs():
    envlist = _tox()["tox"]["envlist"].split()
    listed = _matrix_environments()
    assert sorted(listed) == sorted(envlist), (set(envlist) ^ set(listed))
    assert len(listed) == len(set(listed))


def test_every_matrix_environment_is_made_of_known_factors_or_has_its_section():
    config = _tox()
    factors = set(re.findall(r"^\s*([a-z0-9{},]+):", config["testenv"]["deps"], flags=re.M))
    known = {f for entry in factors for f in re.split(r"[{},]", entry) if f}
    known |= {f"torch{v}" for entry in factors if entry.startswith("torch{") for v in re.split(r"[{},]", entry[6:]) if v}
    for name in _matrix_environments():
        if config.has_section(f"testenv:{name}"):
            continue
        # pyNN: tox's own factor for the interpreter
        unknown = [f for f in name.split("-") if f not in known and not re.fullmatch(r"py3\d+", f)]
        assert not unknown, f"{name}: factors {unknown} select nothing in tox.ini"


def test_the_readme_opens_with_the_demo_and_the_test_command_ci_runs():
    head = (ROOT / "README.md").read_text().split("\n")[:12]
    block = head[head.index("```bash") + 1:]
    demo, tests = block[0].split("#")[0].strip(), block[1].split("#")[0].strip()
    assert demo.endswith("lightning-fsdp-resume demo") and ".[demo]" in demo
    assert tests == "bash .ci/run"


def test_ci_runs_the_gate_after_tox_whatever_tox_runs():
    """The gate is no tox environment that a change to env_list could leave out: .ci/run runs it after tox, on a
    results folder emptied first, and fails when either fails."""
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines.index("rm -rf .tox/results") < lines.index(".venv/bin/tox") < lines.index(".venv/bin/python .ci/gate.py .tox/results")
    assert lines[-1] == "exit $((matrix != 0 || gate != 0))"
    assert not any("gate" in env for env in _tox()["tox"]["envlist"].split())


def test_the_readme_promises_the_cells_the_gate_checks():
    """README's table of tested releases is rendered from .ci/cells.json, which the gate fails on where one did not run."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gate", ROOT / ".ci" / "gate.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    assert gate.markdown(json.loads((ROOT / ".ci" / "cells.json").read_text())) in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(document):
    path = ROOT / document
    links = re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(path.read_text()))
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        target_path = (path.parent / target).resolve() if target else path
        assert target_path.exists(), f"{document}: {link}: no such file"
        if anchor:
            assert anchor in _anchors(target_path), f"{document}: {link}: no such heading"


def test_the_readme_is_one_page_in_the_order_of_its_sections():
    """At most 1,500 words of prose (code blocks and tables left out): what it is, the demo behind the first command,
    install, quick start, one table of what you get (each row leading to the page of docs/ that holds its detail),
    short limitations, links; the rest lives in docs/."""
    text = (ROOT / "README.md").read_text()
    words = len(_prose(text).split())
    assert words <= 1500, f"README.md has {words} words of prose"
    headings = re.findall(r"^## (.+)$", _without_code_blocks(text), flags=re.M)
    assert headings == ["Who needs it", "See it work", "Install", "Quick start", "What you get", "Limitations", "More"]
    table = text.split("## What you get", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| feature |")]
    assert rows and all(re.search(r"\]\(docs/[a-z]+\.md(#[\w-]+)?\) \|$", row) for row in rows), "a row leads to no page of docs/"
    pages = {re.search(r"\]\(docs/([a-z]+\.md)", row).group(1) for row in rows}
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")}, "a page of docs/ that no row of the table leads to"


def test_the_workflow_table_is_the_one_the_workflow_tests_check():
    """The table of docs/resuming.md is rendered from support/workflows.py, whose expected failures (strict) the
    matrix checks."""
    from support.workflows import markdown

    assert markdown() in (ROOT / "docs" / "resuming.md").read_text()


def test_the_benchmark_documents_quote_the_targets_the_benchmarks_check():
    """docs/benchmark.md's tables of targets are the ones the benchmarks print from their constants (the resume
    benchmark's, the save's shadow's); the data position's target is quoted from its benchmark's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import data_position
        import resume_benchmark
        import save_shadow
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "docs" / "benchmark.md").read_text()
    assert resume_benchmark.targets_markdown() in text and save_shadow.targets_markdown() in text
    assert f"Target: leaving out by index costs at most {data_position.TARGET:.0%}".replace("%", " %") in text
