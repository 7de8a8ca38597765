"""Print the tox matrix table (environment, Lightning, torch, shim mode, passed, skipped, failed).

Run by tox's last environment with the results folder the others wrote into. Exits non-zero when an
environment of the envlist reported failures or errors, or reported nothing.
"""
import configparser
import json
import sys
from pathlib import Path


def main(results: Path, tox_ini: Path) -> int:
    config = configparser.ConfigParser()
    config.read(tox_ini)
    envs = [e.strip() for e in config["tox"]["envlist"].split() if e.strip() and e.strip() != "summary"]
    header = ("environment", "Lightning", "torch", "shim mode", "passed", "skipped", "failed")
    rows, ok = [], True
    for env in envs:
        path = results / f"{env}.json"
        if not path.is_file():
            rows.append((env, "-", "-", "NO RESULTS", "-", "-", "-"))
            ok = False
            continue
        r = json.loads(path.read_text())
        lightning = ", ".join(f"{p} {v}" for p, (v, _) in r["lightning"].items())
        modes = ", ".join(sorted({m for _, m in r["lightning"].values()}))
        failed = r["failed"] + r["error"]
        ok = ok and failed == 0
        rows.append((env, lightning, r["torch"], modes, r["passed"], r["skipped"], failed))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
