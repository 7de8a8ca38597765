"""The gate after the matrix: what ran is what was recorded, test id by test id, and every cell the README promises ran.

    python .ci/gate.py RESULTS            check a tox run's results folder (.ci/run does, after tox); print the table
    python .ci/gate.py --record RESULTS   write .ci/outcomes/ from a clean clone's run that passed

Each environment's pytest run writes one results file (tests/conftest.py): the releases installed, the shim's mode
and every test id's outcome (passed; skipped or an expected failure, with its reason). The gate fails

- where a test failed, or an environment recorded in .ci/outcomes/ wrote no results (left out of tox's env_list, its
  interpreter missing, its setenv without the results variable), or one that wrote results has no record;
- where a test id moved from its recorded outcome (a pass that became a skip, a skip that became a pass, another
  skip reason) or is no longer collected; a new test id may pass, but not skip or be expected to fail unrecorded;
- where a cell of .ci/cells.json (the Lightning × torch × Python releases the README's table promises) was run by
  no environment, whatever tox's env_list says.

It runs in .ci/run after tox, not as a tox environment that a change to tox.ini could leave out.
"""
import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ROOT / ".ci" / "outcomes"
CELLS = ROOT / ".ci" / "cells.json"
PASSED = "passed"
# The Lightning packages each Lightning distribution of a cell ships (its Trainer's and its Fabric's)
LIGHTNING_PACKAGES = {"lightning": ("lightning.pytorch", "lightning.fabric"), "pytorch-lightning": ("pytorch_lightning", "lightning_fabric")}


def _release(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def matches(spec: str, version: str) -> bool:
    """Whether ``version`` is what a cell's ``spec`` asks for: ``2.4`` (that release, any patch), ``2.4.1`` (that one),
    ``>=2.6`` (that or newer)."""
    if spec.startswith(">="):
        return _release(version) >= _release(spec[2:])
    return version == spec or version.startswith(spec + ".")


def covers(results: dict, cell: dict) -> bool:
    """Whether an environment's ``results`` ran ``cell``: its Python, every distribution the cell names at the release
    it asks for, and the shim in the cell's mode for the Lightning packages of the cell's Lightning distribution."""
    installed = results["installed"]
    if not matches(cell["python"], results["python"]) or not all(
            distribution in installed and matches(spec, installed[distribution])
            for distribution, spec in cell["releases"].items()):
        return False
    lightning = next(d for d in cell["releases"] if d in LIGHTNING_PACKAGES)
    modes = [results["lightning"][p][1] for p in LIGHTNING_PACKAGES[lightning] if p in results["lightning"]]
    return bool(modes) and all(mode == cell["mode"] for mode in modes)


def cell_name(cell: dict) -> str:
    releases = " · ".join(f"{d} {s}" for d, s in cell["releases"].items())
    return f"{releases} · Python {cell['python']} ({cell['mode']})"


def markdown(cells: List[dict]) -> str:
    """The README's table of the cells (tests/test_docs.py holds the two to agree)."""
    lines = ["| Lightning | torch | Python | wrapt | the shim |", "|---|---|---|---|---|"]
    for cell in cells:
        releases = dict(cell["releases"])
        lightning = next(d for d in releases if d in LIGHTNING_PACKAGES)
        lines.append(f"| `{lightning}` {releases.pop(lightning)} | {releases.pop('torch')} | {cell['python']} |"
                     f" {releases.pop('wrapt', 'newest')} | {cell['mode']} |")
    return "\n".join(lines)


def moved(recorded: Dict[str, str], got: Dict[str, str]) -> List[str]:
    """Each test id whose outcome is not the recorded one, one line each."""
    lines = [f"  {test}: {recorded[test]} -> {got[test]}" for test in sorted(recorded.keys() & got.keys())
             if recorded[test] != got[test]]
    lines += [f"  {test}: {recorded[test]} -> not collected" for test in sorted(recorded.keys() - got.keys())]
    lines += [f"  {test}: new, {got[test]} (record it)" for test in sorted(got.keys() - recorded.keys())
              if got[test] != PASSED]
    return lines


def _failed(outcomes: Dict[str, str]) -> List[str]:
    return sorted(test for test, outcome in outcomes.items() if outcome in ("failed", "error", "xpassed"))


def _load(folder: Path) -> Dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def _table(results: Dict[str, dict]) -> None:
    header = ("environment", "Python", "Lightning", "torch", "shim mode", "passed", "skipped", "expected failures",
              "deselected", "failed")
    rows = []
    for env, r in results.items():
        counts = Counter(outcome.split(":")[0] for outcome in r["outcomes"].values())
        lightning = ", ".join(f"{p} {v}" for p, (v, _) in r["lightning"].items())
        modes = ", ".join(sorted({m for _, m in r["lightning"].values()}))
        rows.append((env, r["python"], lightning, r["installed"].get("torch", "-"), modes, counts[PASSED],
                     counts["skipped"], counts["xfailed"], r["deselected"], len(_failed(r["outcomes"]))))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


def check(results_dir: Path, outcomes_dir: Path = OUTCOMES, cells_path: Path = CELLS) -> int:
    """Print the matrix table and what fails the gate; 0 where nothing does."""
    results, records = _load(results_dir), _load(outcomes_dir)
    _table(results)
    problems = []
    for env in sorted(records.keys() - results.keys()):
        problems.append(f"{env}: wrote no results (not run, or run without {results_dir}/{env}.json)")
    for env in sorted(results.keys() - records.keys()):
        problems.append(f"{env}: no recorded outcomes in {outcomes_dir.name}/ (record a clean clone's run: gate.py --record)")
    for env in sorted(results.keys() & records.keys()):
        got = results[env]["outcomes"]
        failed = _failed(got)
        if failed:
            problems.append(f"{env}: {len(failed)} failed\n" + "\n".join(f"  {test}: {got[test]}" for test in failed))
        lines = moved(records[env]["outcomes"], {t: o for t, o in got.items() if t not in failed})
        if lines:
            problems.append(f"{env}: {len(lines)} test ids moved from their recorded outcome\n" + "\n".join(lines))
    for cell in json.loads(cells_path.read_text()):
        if not any(covers(r, cell) for r in results.values()):
            problems.append(f"cell not run by any environment: {cell_name(cell)} (README promises it; {cells_path.name})")
    if problems:
        print("\nThe gate fails:\n" + "\n".join(problems))
        return 1
    print(f"\nThe gate passes: {len(results)} environments as recorded, every cell of {cells_path.name} run.")
    return 0


def record(results_dir: Path, outcomes_dir: Path = OUTCOMES) -> int:
    """Write each environment's outcomes from a run that passed, with the commit it ran."""
    results = _load(results_dir)
    failed = {env: _failed(r["outcomes"]) for env, r in results.items() if _failed(r["outcomes"])}
    if not results or failed:
        print(f"Nothing recorded: {'failures in ' + ', '.join(failed) if failed else 'no results in ' + str(results_dir)}")
        return 1
    commit = subprocess.run(["git", "-C", str(results_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
    outcomes_dir.mkdir(parents=True, exist_ok=True)
    for stale in outcomes_dir.glob("*.json"):
        stale.unlink()
    for env, r in results.items():
        entry = {"recorded_from": commit.stdout.strip() or "unknown", "python": r["python"], "outcomes": r["outcomes"]}
        (outcomes_dir / f"{env}.json").write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
    print(f"Recorded {len(results)} environments into {outcomes_dir}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="the results folder of a tox run (.tox/results)")
    parser.add_argument("--record", action="store_true", help="write .ci/outcomes/ from it instead of checking it")
    args = parser.parse_args(argv)
    return record(args.results) if args.record else check(args.results)


if __name__ == "__main__":
    sys.exit(main())
