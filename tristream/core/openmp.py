"""OpenMP waits for processes that run several compute stages on a few cores.

The engine's CPU kernels run on torch's OpenMP threads (libgomp). By default a libgomp thread
that has finished its share spins for a while before it sleeps. Alone on the machine that
saves a wake-up per parallel region. Beside Whisper, piper and other sessions on two cores, the
spinning threads hold the cores that the thread the region waits for needs: decode time per
token grew several-fold in our runs (`bench/e2e_cpu.py --section omp` and `--omp`, `docs/assistant.md`).
``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once.

libgomp reads the variable once, when it is loaded (at ``import torch``), so it is set before
that: `prefer_passive_waits` is called when `tristream.pipeline` is imported, and a value the
user set is kept.
"""

from __future__ import annotations

import os
import sys

ENV = "OMP_WAIT_POLICY"


def prefer_passive_waits() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy; True when the policy in
    force is passive (False: the user chose another, or torch was loaded before with another)."""
    if ENV in os.environ:
        return os.environ[ENV].upper() == "PASSIVE"
    if "torch" in sys.modules:  # too late: libgomp has read its settings
        return False
    os.environ[ENV] = "PASSIVE"
    return True
