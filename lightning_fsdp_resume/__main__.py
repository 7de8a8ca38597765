"""``python -m lightning_fsdp_resume {demo,status,consolidate}``."""
import sys

from .cli import main

sys.exit(main())
