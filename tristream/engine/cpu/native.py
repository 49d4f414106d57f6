"""The native CPU kernels (`qkernels.c`): which instruction set this CPU offers, compiling the
file once per instruction set into the cache, and calling it.

The kernels are chosen from what the CPU has, never from the machine they were written on:
AVX-512 VNNI (with VL/BW) where present, else AVX2 + FMA + F16C. ``ATEN_CPU_CAPABILITY`` (which
forces torch's own kernels onto a lower instruction set) lowers ours the same way, and
``TRISTREAM_CPU_ISA`` (``avx512vnni``, ``avx2`` or ``none``) picks one explicitly. The shared
library is built with the system C compiler (``$CC``, else ``cc``/``gcc``) into
``<cache>/kernels/`` the first time it is needed (about a second) and reused afterwards.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ISA_ENV = "TRISTREAM_CPU_ISA"
ISAS = ("avx512vnni", "avx2")
_SOURCE = Path(__file__).with_name("qkernels.c")
_ABI = 5
_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                   "-DTS_VNNI"],
}
# /proc/cpuinfo flag names each instruction set needs
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
}


class UnsupportedCPU(RuntimeError):
    """The requested kernels need an instruction set this CPU (or its forced setting) lacks."""


@dataclass(frozen=True, slots=True)
class Kernels:
    """The loaded library and the instruction set it was built for."""

    isa: str
    lib: ctypes.CDLL


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def best_isa(flags: set[str] | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The instruction set the kernels use here: the best the CPU has, lowered by
    ``ATEN_CPU_CAPABILITY`` and overridden by ``TRISTREAM_CPU_ISA``; None when neither is usable."""
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    have = [isa for isa in ISAS if _NEEDS[isa] <= flags]
    want = env.get(ISA_ENV, "").strip().lower()
    if want:
        if want == "none":
            return None
        if want not in ISAS:
            raise UnsupportedCPU(f"${ISA_ENV} must be one of {', '.join(ISAS)} or none, not {want!r}")
        if want not in have:
            missing = sorted(_NEEDS[want] - flags)
            raise UnsupportedCPU(f"${ISA_ENV}={want} but this CPU lacks {', '.join(missing)}")
        return want
    cap = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap in ("default", "none"):
        return None
    if cap and not cap.startswith("avx512"):
        have = [isa for isa in have if not isa.startswith("avx512")]
    return have[0] if have else None


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(isa: str, folder: Path) -> Path:
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set $CC or install gcc)")
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", *_FLAGS[isa]]
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(" ".join([cc, *flags]).encode())
    out = folder / f"qkernels-{isa}-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    proc = subprocess.run([cc, *flags, str(_SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        err = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise OSError(f"compiling {_SOURCE.name} for {isa} failed: {err}")
    tmp.replace(out)
    for stale in folder.glob(f"qkernels-{isa}-*.so"):  # builds of earlier sources (a loaded one stays mapped)
        if stale != out:
            stale.unlink(missing_ok=True)
    return out


_lock = threading.Lock()
_loaded: dict[str, Kernels] = {}
_errors: dict[str, str] = {}


def _bind(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ts_abi_version.restype = ctypes.c_int
    lib.ts_linear_q4.argtypes = [p, i64, i64, p, p, p, i64, p, p]
    lib.ts_linear_q4.restype = ctypes.c_int
    lib.ts_linear_q8.argtypes = [p, i64, i64, p, p, i64, p, p]
    lib.ts_linear_q8.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.ts_alloc_huge.argtypes = [i64]
    lib.ts_alloc_huge.restype = p
    lib.ts_free.argtypes = [p]
    lib.ts_free.restype = None
    lib.ts_add_rms_norm.argtypes = [p, p, i64, i64, p, f32, p]
    lib.ts_add_rms_norm.restype = None
    lib.ts_silu_mul.argtypes = [p, i64, i64, p]
    lib.ts_silu_mul.restype = None
    lib.ts_attn_decode.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, p, p, f32, p]
    lib.ts_attn_decode.restype = None


def load(isa: str | None = None) -> Kernels | None:
    """The kernels for `isa` (default: `best_isa()`), built on first use; None when this CPU
    has no supported instruction set or no compiler is available (`last_error()` says why)."""
    import torch  # noqa: F401  (load torch's OpenMP runtime first: the kernels then share it)

    from tristream.engine.disk_cache import cache_root

    isa = best_isa() if isa is None else isa
    if isa is None:
        _errors["none"] = "this CPU has neither AVX2+FMA+F16C nor AVX-512 VNNI (or they are turned off)"
        return None
    with _lock:
        if isa in _loaded:
            return _loaded[isa]
        try:
            lib = ctypes.CDLL(str(_build(isa, cache_root() / "kernels")))
            _bind(lib)
            if lib.ts_abi_version() != _ABI:
                raise OSError(f"kernel library reports ABI {lib.ts_abi_version()}, expected {_ABI}")
        except OSError as e:
            _errors[isa] = str(e)
            return None
        _loaded[isa] = k = Kernels(isa, lib)
        return k


def last_error() -> str:
    """Why the last `load()` returned None ('' when it did not)."""
    return "; ".join(_errors.values())


class HugeBuffer:
    """One block of memory on huge pages (where the OS allows) holding many tensors' bytes.

    The block is freed when the last tensor taken from it is gone (the tensors keep the
    buffer object alive, and it frees the memory when it is collected)."""

    def __init__(self, kernels: Kernels, nbytes: int) -> None:
        import weakref

        import torch

        n = max(1, nbytes)
        ptr = kernels.lib.ts_alloc_huge(n)
        if not ptr:
            raise MemoryError(f"could not allocate {nbytes} bytes for the weights")
        arr = (ctypes.c_uint8 * n).from_address(ptr)
        weakref.finalize(arr, kernels.lib.ts_free, ptr)
        self.bytes = torch.frombuffer(arr, dtype=torch.uint8)
        self.used = 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` inside the buffer (64-byte aligned)."""
        n = t.numel() * t.element_size()
        start = (self.used + 63) // 64 * 64
        out = self.bytes[start:start + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used = start + n
        return out


def main() -> None:
    """`python -m tristream.engine.cpu.native`: build the kernels for this CPU now (the install
    step runs it; without it they are built on first use) and say which instruction set runs."""
    import sys

    try:
        isa = best_isa()
    except UnsupportedCPU as e:
        print(f"native CPU kernels: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    built = [k.isa for k in (load(i) for i in dict.fromkeys([isa, "avx2"]) if i) if k is not None]
    if isa is None or not built:
        print(f"native CPU kernels unavailable ({last_error()}): the CPU path runs dense float32", file=sys.stderr)
        return
    print(f"native CPU kernels: {isa} (built: {', '.join(built)})")


if __name__ == "__main__":
    main()
