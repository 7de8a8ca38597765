"""CONTRIBUTING.md's matrix table is checked against the tox matrix."""
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _tox():
    config = configparser.ConfigParser()
    config.read(ROOT / "tox.ini")
    return config


def _matrix_environments():
    """The first column of CONTRIBUTING.md's matrix table."""
    return re.findall(r"^\| `([a-z0-9-]+)` \|", (ROOT / "CONTRIBUTING.md").read_text(), flags=re.M)


def test_the_matrix_table_lists_exactly_the_environments_tox_runs():
    envlist = [e for e in _tox()["tox"]["envlist"].split() if e != "summary"]
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
