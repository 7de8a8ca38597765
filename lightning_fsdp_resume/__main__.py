"""``python -m lightning_fsdp_resume {demo,status}``."""
import sys

from .cli import main

sys.exit(main())
