"""What ``import lightning_fsdp_resume`` costs on top of ``import wrapt``, and that it imports no torch or Lightning.

Each measurement is a fresh interpreter timing its own imports (interpreter start-up left out); the
two programs alternate, and the medians are compared.
"""
import json
import statistics
import subprocess
import sys
from typing import Dict, List, Mapping, Optional

HEAVY = ("torch", "lightning", "pytorch_lightning")

_PROGRAM = """\
import json, sys, time
start = time.perf_counter()
import wrapt
{imports}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""
BASELINE = _PROGRAM.format(imports="", heavy=HEAVY)
WITH_SHIM = _PROGRAM.format(imports="import lightning_fsdp_resume", heavy=HEAVY)


def _run(python: str, program: str, env: Optional[Mapping[str, str]]) -> Dict:
    result = subprocess.run([python, "-c", program], capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{python} -c <import timing> exited {result.returncode}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(python: str = sys.executable, repeats: int = 40, env: Optional[Mapping[str, str]] = None) -> Dict:
    """Median import times in seconds of wrapt alone and of wrapt then the shim, and any heavy module imported."""
    baseline: List[float] = []
    with_shim: List[float] = []
    heavy = set()
    for _ in range(repeats):
        baseline.append(_run(python, BASELINE, env)["seconds"])
        shim = _run(python, WITH_SHIM, env)
        with_shim.append(shim["seconds"])
        heavy.update(shim["heavy"])
    return {
        "repeats": repeats,
        "wrapt": statistics.median(baseline),
        "wrapt_and_shim": statistics.median(with_shim),
        "added": statistics.median(with_shim) - statistics.median(baseline),
        "spread": (min(with_shim), max(with_shim)),
        "heavy_imported": sorted(heavy),
    }
