"""Where the Whisper "encode" graph's time goes (log-mel, conv front, encoder layers, cross K/V), and
candidate cuts, each captured as its own CUDA graph and timed in the same run.

    python bench/whisper_encode.py                    # tiny, 16 streams × 10 s (the #4 pass)
    python bench/whisper_encode.py --streams 1,16,64 --model tiny

Writes bench/results/whisper_encode.json (machine, versions, commit; the committed run is
whisper_encode_round.json). GPU only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import capture_graph, cuda_graph_ms, kernel_profile, write_results  # noqa: E402
from tristream.speech import kernels  # noqa: E402
from tristream.speech.config import PRESETS, SAMPLE_RATE  # noqa: E402
from tristream.speech.mel import LogMel  # noqa: E402
from tristream.speech.whisper import Whisper  # noqa: E402


def graph_ms(fn: Callable[[], object]) -> float:
    """`fn` captured alone (after a warm-up outside the graph), ms per replay."""
    return round(cuda_graph_ms(capture_graph(fn, warm=2), warm=5, reps=50), 4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def bench(model: str, streams: int, seconds: float) -> dict[str, Any]:
    dims = PRESETS[model]
    dev, dt = torch.device("cuda"), torch.float16
    torch.manual_seed(0)
    m = Whisper(dims).to(dev)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.05)
    m = m.to(dt).eval()
    mel_mod = LogMel(dims.n_mels).to(dev)
    n = int(seconds * SAMPLE_RATE)
    audio = torch.randn(streams, n, device=dev) * 0.1
    cache = m.new_cache(streams, n // 320, 48, device=dev, dtype=dt)
    out: dict[str, Any] = {"streams": streams, "seconds": seconds}
    with torch.inference_mode():
        mel = mel_mod(audio).to(dt)
        t = mel.shape[2] // 2
        x0 = F.gelu(m.conv2(F.gelu(m.conv1(mel)))).transpose(1, 2)
        x = (m.enc_pos[:t].to(dt) + x0).contiguous()
        lay = m.enc_layers[0]
        h = lay.ln1(x)
        b, nn_, d = x.shape
        qkv = lay.qkv(h)
        q, k, v = qkv.view(b, nn_, 3, lay.heads, d // lay.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        a2 = a.transpose(1, 2).reshape(b, nn_, d)
        f1 = lay.fc1(h)
        g1 = F.gelu(f1)
        enc = m.encode(mel, fused=True)
        parts: dict[str, Callable[[], object]] = {
            "mel": lambda: mel_mod(audio),
            "mel_torch_f16": lambda: mel_mod.forward_torch(audio).to(dt),
            "mel_kernels_f16": lambda: mel_mod(audio, out_dtype=dt),
            "mel_kernels_f16_transposed": lambda: mel_mod(audio, out_dtype=dt, transpose=True),
            "stft_only": lambda: torch.stft(audio, 400, 160, window=mel_mod.window, return_complex=True),
            "conv1_gelu": lambda: F.gelu(m.conv1(mel)),
            "conv_front_pos": lambda: m.enc_pos[:t].to(dt) + F.gelu(m.conv2(F.gelu(m.conv1(mel)))).transpose(1, 2),
            "layer_fused": lambda: lay.forward_fused(x, h, m.enc_ln),
            "ln": lambda: lay.ln1(x),
            "qkv_gemm": lambda: lay.qkv(h),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "sdpa_qkv_contig": lambda: F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous()),
            "attn_transpose_out": lambda: lay.out(a.transpose(1, 2).reshape(b, nn_, d)),
            "add_ln": lambda: kernels.add_layer_norm(x, a2, lay.ln2),
            "fc1": lambda: lay.fc1(h),
            "gelu": lambda: F.gelu(f1),
            "fc1_gelu_tanh_epilogue": lambda: torch._addmm_activation(lay.fc1.bias, h.view(-1, d), lay.fc1.weight.T,
                                                                       use_gelu=True),
            "fc2": lambda: lay.fc2(g1),
            "fill_cross": lambda: m.fill_cross(enc, cache),
            "encode_fused": lambda: m.encode(mel, fused=True),
            "whole_encode_graph": lambda: (m.encode(mel_mod(audio).to(dt), fused=True), m.fill_cross(enc, cache)),
        }
        m.gemm_front = False
        ref_enc = m.encode(mel, fused=True)
        exact = m.encode(mel.float().to(dt), fused=False)
        m.gemm_front = True

        def cudnn_front(fn: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                m.gemm_front = False
                try:
                    return fn()
                finally:
                    m.gemm_front = True
            return run
        parts["encode_fused_cudnn_front"] = cudnn_front(parts["encode_fused"])
        parts["whole_encode_graph_cudnn_front"] = cudnn_front(parts["whole_encode_graph"])
        gemm_enc = m.encode(mel, fused=True)
        out["encoder_rel_err"] = {"gemm_front_vs_cudnn_front": rel(gemm_enc, ref_enc),
                                  "gemm_front_vs_unfused": rel(gemm_enc, exact),
                                  "cudnn_front_vs_unfused": rel(ref_enc, exact)}
        parts["conv_gemms"] = lambda: m._conv_gemms(mel)
        parts["conv_gemms_pos_ln"] = lambda: kernels.add_layer_norm(m._conv_gemms(mel), m.enc_pos[:t].to(dt),
                                                                    m.enc_layers[0].ln1)
        for rows in ((1, 1), (1, 2), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8), (32, 8)):
            parts[f"add_ln_rows{rows[0]}_w{rows[1]}"] = lambda rows=rows: kernels.add_layer_norm(x, a2, lay.ln2,
                                                                                                rows=rows)
        for name in ("flash", "efficient", "cudnn"):
            be = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                  "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                  "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}[name]

            def run(be: Any = be) -> object:
                with torch.nn.attention.sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v)
            parts["sdpa_" + name] = run
        ms: dict[str, float | str] = {}
        for name, fn in parts.items():
            try:
                ms[name] = graph_ms(fn)
            except Exception as e:  # a backend that does not take this shape
                ms[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
            print(f"  {streams:3d} streams  {name:28s} {ms[name]}")
        out["graph_ms"] = ms
        tanh = torch._addmm_activation(lay.fc1.bias, h.view(-1, d), lay.fc1.weight.T, use_gelu=True)
        out["gelu_tanh_epilogue_rel_err"] = rel(tanh, g1.view(-1, tanh.shape[1]))
        out["mel_kernels_vs_torch_max_abs"] = float((mel_mod(audio) - mel_mod.forward_torch(audio)).abs().max())
        out["shapes"] = {"x": list(x.shape), "mel": list(mel.shape), "ffn": dims.ffn}
        out["kernel_profile_encode"] = kernel_profile(
            lambda: (m.encode(mel_mod(audio).to(dt), fused=True), m.fill_cross(enc, cache)), top=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--streams", default="16")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--name", default="whisper_encode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("whisper_encode.py needs a CUDA GPU")
    res = {"model": args.model, "runs": [bench(args.model, int(s), args.seconds) for s in args.streams.split(",")]}
    for r in res["runs"]:
        print(f"\n{r['streams']} streams: top kernels of the encode graph "
              f"({r['kernel_profile_encode']['kernel_time_us']} µs in {r['kernel_profile_encode']['kernels']})")
        for row in r["kernel_profile_encode"]["top"]:
            print(f"  {row['us']:8.1f} µs  {row['count']:3d}×  {row['kernel'][:100]}")
    print("wrote", write_results(args.name, res))


if __name__ == "__main__":
    main()
