"""`python -m tristream.cli ...` with a side thread that samples the Python stack of every thread
(`sys._current_frames`, ``TRISTREAM_STACK_HZ`` times a second, default 50) and rewrites the counts
to ``$TRISTREAM_STACK_SAMPLE`` (JSON) every 2 s: the main thread's leaf and inclusive frames, the
other threads' leaf frames by thread name, and the thread names by native id (for /proc's per-thread
CPU). `bench/serve_gpu.py --profile` starts the server through it and diffs the counts per run.

    TRISTREAM_STACK_SAMPLE=/tmp/s.json python3 bench/serve_sampled.py serve --token T --port P
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from collections import Counter


def _key(code: object) -> str:
    co = code  # a code object
    fn = co.co_filename  # type: ignore[attr-defined]
    i = fn.find("tristream/")
    short = fn[i:] if i >= 0 else "/".join(fn.split("/")[-2:])
    return f"{co.co_name} ({short}:{co.co_firstlineno})"  # type: ignore[attr-defined]


def _sample(path: str, hz: float) -> None:
    main = threading.main_thread().ident
    leaf: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    other: dict[str, Counter[str]] = {}
    samples = 0
    last = time.monotonic()
    me = threading.get_ident()
    while True:
        time.sleep(1 / hz)
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        samples += 1
        for tid, f in frames.items():
            if tid == me:
                continue
            if tid == main:
                leaf[_key(f.f_code)] += 1
                seen: set[str] = set()
                g = f
                while g is not None:
                    k = _key(g.f_code)
                    if k not in seen:
                        seen.add(k)
                        incl[k] += 1
                    g = g.f_back
            else:
                name = names.get(tid, "?").rstrip("0123456789_-")
                other.setdefault(name, Counter())[_key(f.f_code)] += 1
        if time.monotonic() - last >= 2.0:
            last = time.monotonic()
            native = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
            doc = {"hz": hz, "samples": samples, "main_leaf": dict(leaf), "main_inclusive": dict(incl),
                   "threads_leaf": {k: dict(v.most_common(40)) for k, v in other.items()}, "native_names": native}
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(doc, fh)
            os.replace(tmp, path)


def main() -> None:
    path = os.environ.get("TRISTREAM_STACK_SAMPLE")
    if path:
        hz = float(os.environ.get("TRISTREAM_STACK_HZ", "50"))
        threading.Thread(target=_sample, args=(path, hz), name="stack-sampler", daemon=True).start()
    sys.argv = ["tristream", *sys.argv[1:]]
    runpy.run_module("tristream.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
