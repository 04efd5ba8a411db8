"""Shared pytest setup: the repo root on sys.path (so spawned ranks can import test helpers)
and quiet megatron/TE warnings."""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
