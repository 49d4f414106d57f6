"""Importing torch before `tristream.pipeline` leaves libgomp's spinning waits on: one warning says
so; imported first, the pipeline sets ``OMP_WAIT_POLICY=PASSIVE`` quietly."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_torch_first_warns_once_and_pipeline_first_is_quiet() -> None:
    late = _run("import torch, tristream.pipeline, os; print(os.environ.get('OMP_WAIT_POLICY'))")
    assert late.returncode == 0, late.stderr
    assert late.stdout.strip() == "None"
    assert late.stderr.count("torch was imported before tristream.pipeline") == 1, late.stderr
    early = _run("import tristream.pipeline, torch, os; print(os.environ.get('OMP_WAIT_POLICY'))")
    assert early.returncode == 0 and early.stdout.strip() == "PASSIVE", early.stderr
    assert "torch was imported before" not in early.stderr
    chosen = _run("import os; os.environ['OMP_WAIT_POLICY'] = 'ACTIVE'; import torch, tristream.pipeline")
    assert chosen.returncode == 0 and "torch was imported before" not in chosen.stderr  # the user chose
