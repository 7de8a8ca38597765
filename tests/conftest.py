import sys
from pathlib import Path

# The tests import their helpers (ranks, states, fsdp_worker) by module name.
sys.path.insert(0, str(Path(__file__).parent))
