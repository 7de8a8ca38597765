"""Print the tox matrix table (environment, Lightning, torch, shim mode, passed, skipped, expected failures,
deselected, failed).

Run by tox's last environment with the results folder the others wrote into. Exits non-zero when an
environment of the envlist reported failures or errors, or reported nothing: its row says why (a ``pyNN``
environment whose interpreter is not on PATH did not run, which fails the matrix as tox itself does). It also
fails where an environment passed fewer tests, expected fewer failures or skipped more than ``.ci/expected.json``
says it does: a test that turned into a skip, or stopped running, fails the matrix until that file is changed.
Each skip's and expected failure's reason follows the table. Environments that run no
tests (`lint`, `summary` itself: their setenv names no results file) have no row; tox reports them.
"""
import configparser
import json
import re
import shutil
import sys
from pathlib import Path

RESULTS_ENV = "LIGHTNING_FSDP_RESUME_RESULTS"


def reports_results(config: configparser.ConfigParser, env: str) -> bool:
    """Whether tox gives ``env`` a results file: its setenv (its own, else [testenv]'s) sets RESULTS_ENV."""
    section = f"testenv:{env}" if config.has_option(f"testenv:{env}", "setenv") else "testenv"
    setenv = config.get(section, "setenv", fallback="")
    # {[xver]setenv}: tox's reference to another section's value
    setenv = re.sub(r"\{\[([^\]]+)\](\w+)\}", lambda ref: config.get(ref[1], ref[2], fallback=""), setenv)
    return RESULTS_ENV in setenv


def missing_interpreter(env: str) -> str:
    """The ``python3.N`` a ``py3N-*`` environment asks for, when it is not on PATH; else ``""``."""
    factor = next((f for f in env.split("-") if re.fullmatch(r"py3\d+", f)), None)
    wanted = f"python3.{factor[3:]}" if factor else ""
    return wanted if wanted and shutil.which(wanted) is None else ""


def short_of(expected: dict, got: dict) -> str:
    """How ``got`` (an environment's counts) falls short of ``expected``; "" where it does not, or nothing is expected."""
    if not expected:
        return ""
    shortfalls = [f"{key} {got.get(key, 0)} < {least}" for key, least in expected.items()
                  if key in ("passed", "xfailed") and got.get(key, 0) < least]
    if got.get("skipped", 0) > expected.get("skipped", 0):
        shortfalls.append(f"skipped {got['skipped']} > {expected.get('skipped', 0)}")
    return "; ".join(shortfalls)


def main(results: Path, tox_ini: Path) -> int:
    config = configparser.ConfigParser()
    config.read(tox_ini)
    expected_path = tox_ini.parent / ".ci" / "expected.json"
    expectations = json.loads(expected_path.read_text()) if expected_path.is_file() else {}
    shortfalls, reasons = [], []
    envs = [e for e in config["tox"]["envlist"].split() if reports_results(config, e)]
    header = ("environment", "Lightning", "torch", "shim mode", "passed", "skipped", "expected failures", "deselected",
              "failed")
    rows, ok = [], True
    for env in envs:
        path = results / f"{env}.json"
        if not path.is_file():
            missing = missing_interpreter(env)
            rows.append((env, "-", "-", f"NOT RUN: no {missing} on PATH" if missing else "NO RESULTS", "-", "-", "-", "-", "-"))
            ok = False
            continue
        r = json.loads(path.read_text())
        lightning = ", ".join(f"{p} {v}" for p, (v, _) in r["lightning"].items())
        modes = ", ".join(sorted({m for _, m in r["lightning"].values()}))
        failed = r["failed"] + r["error"]
        ok = ok and failed == 0
        short = short_of(expectations.get(env, {}), r)
        if short:
            shortfalls.append(f"{env}: {short}")
        reasons += [f"{env}: {count} skipped: {why}" for why, count in sorted(r.get("skip_reasons", {}).items())]
        reasons += [f"{env}: {count} expected to fail: {why}" for why, count in sorted(r.get("xfail_reasons", {}).items())]
        # deselected: left out by the environment's -m selection (tox.ini), not skipped; 0 in results of before it was counted
        rows.append((env, lightning, r["torch"], modes, r["passed"], r["skipped"], r.get("xfailed", "-"), r.get("deselected", 0),
                     failed))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    if reasons:
        print("\n" + "\n".join(reasons))
    if shortfalls:
        print(f"\nFewer tests ran than {expected_path.name} expects (update it where that is meant):\n" + "\n".join(shortfalls))
    return 0 if ok and not shortfalls else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
