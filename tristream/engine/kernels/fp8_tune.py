"""Per-shape kernel choice for fp8 weights: time `fp8_gemv`'s candidates on this device, keep the fastest.

`tune_model` runs after quantising (`quantize.quantize_model_fp8`, the FP8 checkpoint loader) and
fills `fp8_gemv.TUNED`, which `fp8_gemv.fp8_linear` and the batch-1 decode (`fp8_decode`) read.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from tristream.engine.kernels import fp8_gemv as G
from tristream.engine.kernels.fp8_gemv import SMALL_M, TUNED, Config, run_config


def candidates(m: int, n: int, k: int) -> list[Config]:
    """The choices `tune_model` times for an [m, k] × [n, k] product."""
    if m == 1:
        gemv = [("gemv", bn, min(bk, triton.next_power_of_2(k)), 4, u)
                for bn, bk, u in ((16, 512, 1), (8, 1024, 1), (4, 2048, 1), (16, 256, 2), (16, 512, 2), (8, 512, 2),
                                  (32, 256, 2))]
        return [*dict.fromkeys(gemv), ("mm", 16, 32, 128, 4, 4)]
    if m <= 8:
        return [("gemvm", bn, bk, w) for bn, bk, w in ((16, 64, 4), (8, 128, 4), (32, 64, 8))] + [
            ("mm", 16, 32, 128, 4, 4), ("mm", 16, 16, 256, 4, 3)]
    if m <= SMALL_M:
        bm = max(16, triton.next_power_of_2(m))
        w = 8 if bm >= 128 else 4
        return [("mm", bm, bn, bk, w, st) for bn, bk, st in ((32, 128, 4), (64, 128, 3), (16, 256, 3), (128, 64, 3))]
    out: list[Config] = [("dequant",), ("mm", 128, 128, 64, 8, 3), ("mm", 128, 128, 64, 8, 4)]
    if G.PREFILL_PATH == "scaled_mm":
        out.append(("scaled_mm",))
    return out


def _graph_ms(fn: Any, reps: int = 5) -> float:
    """ms per replay (median) of a CUDA graph of `fn` (compiled first, outside the capture)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    del g
    return sorted(ts)[len(ts) // 2]


def tune_model(model: Any, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 0),
               prefill_rows: int = 512) -> dict[str, Any]:
    """Time `candidates` for every fp8 projection shape of `model` and row bucket, each as one CUDA
    graph over that projection of every layer (as a decode step reads them: none from L2), and
    keep the fastest in `TUNED`; candidates that fail to compile or disagree with the reference
    (rel err > 2e-2) are skipped. Returns {"ms": {shape/bucket: {config: ms}}, "s": seconds}."""
    import time

    from tristream.engine.linear import fp8_reference

    t0 = time.perf_counter()
    groups: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            if lin.qformat == "fp8":
                groups.setdefault((lin.out_features, lin.in_features), []).append(lin.qtensors)
    head = model.head()
    if head.qformat == "fp8":
        groups.setdefault((head.out_features, head.in_features), []).append(head.qtensors)
    report: dict[str, Any] = {}
    gen = torch.Generator(device=model.device).manual_seed(0)
    for (n, k), ts in groups.items():
        for b in buckets:
            m = prefill_rows if b == 0 else b
            x = torch.randn(m, k, device=model.device, dtype=model.dtype, generator=gen)
            ref = fp8_reference(x, ts[0]["w"], ts[0]["s"]).float()
            times: dict[str, float] = {}
            for cfg in candidates(m, n, k):
                try:
                    y = run_config(cfg, x, ts[0]["w"], ts[0]["s"]).float()
                    if float((y - ref).norm() / ref.norm().clamp(min=1e-30)) > 2e-2:
                        continue

                    def all_layers(cfg: Config = cfg, x: torch.Tensor = x,
                                   ts: list[dict[str, torch.Tensor]] = ts) -> None:
                        for t in ts:
                            run_config(cfg, x, t["w"], t["s"])

                    times[",".join(map(str, cfg))] = _graph_ms(all_layers) / len(ts)
                except Exception:  # out of resources for this tile, or no FP8 cuBLASLt kernel
                    continue
            if times:
                best = min(times, key=lambda c: times[c])
                TUNED[(b, n, k)] = tuple(int(v) if v.isdigit() else v for v in best.split(","))
                report[f"{n}x{k}/m{b or prefill_rows}"] = times
    torch.cuda.empty_cache()
    return {"ms": report, "s": time.perf_counter() - t0}
