"""`core.openmp.prefer_passive_waits`: set before torch loads, never over the user's choice."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip()


def test_importing_the_pipeline_first_makes_openmp_waits_passive() -> None:
    code = "import os, tristream.pipeline, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _run(code) == "PASSIVE"


def test_a_policy_the_user_chose_is_kept() -> None:
    code = ("import os; from tristream.core.openmp import prefer_passive_waits; "
            "print(prefer_passive_waits(), os.environ['OMP_WAIT_POLICY'])")
    assert _run(code, OMP_WAIT_POLICY="active") == "False active"
    assert _run(code, OMP_WAIT_POLICY="passive") == "True passive"


def test_too_late_once_torch_is_loaded() -> None:
    code = ("import os, torch; from tristream.core.openmp import prefer_passive_waits; "
            "print(prefer_passive_waits(), os.environ.get('OMP_WAIT_POLICY'))")
    assert _run(code) == "False None"
