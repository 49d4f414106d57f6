"""The CPU kernel and quality tests again with the AVX2 path forced (torch's, oneDNN's and ours).

Those settings are read at process start, so the tests run in a child pytest. On an AVX2-only
machine this repeats the native run; on an AVX-512 machine it is what checks the AVX2 code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tristream.engine.cpu import native

HERE = Path(__file__).parent
FORCED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", native.ISA_ENV: "avx2",
          "TRISTREAM_EXPECT_ISA": "avx2"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kernels_and_quality_with_the_avx2_path_forced() -> None:
    if not native._NEEDS["avx2"] <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, **FORCED}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(HERE / "test_cpu_kernels.py"), str(HERE / "test_cpu_quality.py")],
        env=env, capture_output=True, text=True, cwd=HERE.parent.parent,
    )
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
