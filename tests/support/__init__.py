"""What the tests share, so that the test modules read as the list of promised behaviours.

``ranks`` launches the rank programs (``trainer_worker``, ``fabric_worker``), forked by ``rank_server`` or
run by torchrun; ``states`` holds what a rank records and how the tests compare it; ``faults`` kills a
rank at a chosen point of a save; ``flavours`` is the Lightning package under test, chosen once;
``marks`` the shared skips (``needs_cpu_fsdp`` and others); ``checkpoints`` a hand-made checkpoint for
the one-process tests. conftest.py puts tests/ on ``sys.path``; the rank programs, run as scripts, put
it there themselves.
"""
