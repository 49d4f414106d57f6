"""Programmatic Dependent Launch (PDL) in the batch-1 decode kernels: when a kernel lets the next
one start, and where it waits for its predecessor.

A kernel launched with PDL (`launch_pdl=True`, Hopper and newer) may start while its predecessor
is still running; `gdc_wait` then blocks until the predecessor has finished and its stores are
visible. What it does before the wait (load constant weights, cached K/V of earlier steps) overlaps
the predecessor. The predecessor decides when its successor may launch: at `gdc_launch_dependents`,
or at its exit.

`USE_PDL` of the kernels (a constexpr), from `pdl_mode`:

- 0: launched without PDL;
- 1: wait, then let the successor launch (the successor's weight loads overlap this kernel's
  work after its wait: one kernel of look-ahead);
- 2: let the successor launch at the very start, then load, then wait. The successor does the
  same, so a chain of such kernels launches several kernels ahead, each loading its weights
  while the kernels before it run. Correct for the same reason as mode 1: every kernel still waits
  for its predecessor, which cannot finish before its own wait returned, so each waits for all
  earlier kernels; none stores before its wait.
"""

from __future__ import annotations

import triton
import triton.language as tl


def pdl_mode(pdl: bool | int) -> int:
    """The `USE_PDL` constexpr of a launch: 0 without PDL; 2 (early trigger) for `pdl == 2`; else 1."""
    if not pdl:
        return 0
    return 2 if pdl == 2 else 1


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """First thing in a kernel: with mode 2, let the successor launch now."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Before the first read of anything the predecessor writes: wait for it (mode 1 then lets the
    successor launch)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
