"""Batch-1 decode step as one persistent CUDA kernel (compiled at run time with NVRTC).

The multi-kernel batch-1 step (`decode_fused.decode_logits_b1`) pays, per kernel, the dependent
chain of a launch: wait for the predecessor's grid, read its output from L2, reduce, store, retire
the grid. For SmolLM2-135M that is 5 kernels × 30 layers at ~2.5 µs each, against ~2 µs of
weight bytes per layer. Here one launch runs the whole step: one block per SM, 8 warps each. The
stages of a layer (norm+QKV+RoPE+KV store, attention, O+residual, norm+gate|up+SiLU,
down+residual, then the final norm + output projection) hand their outputs on through tagged
words instead of kernel boundaries or barriers:

* every activation element is a 32-bit word, its bf16 value in the high half and a 16-bit tag in
  the low half: (launch epoch, layer, stage). A producer stores it (relaxed, to L2). In each block
  one warp polls the end of the row a stage needs while the stage's other warps sleep at a named
  barrier (`block_gate`); then every warp reads the whole row and reads again until every word
  carries the tag it expects. Value and tag arrive in one access, so there is no fence and no
  counter (NCCL's LL protocol, for one GPU);
* each warp loads its weights for a stage (constant) before it polls, so their HBM latency
  overlaps the wait; attention loads the cached keys and values of earlier positions before it
  polls too (the newest k and v come tagged, with q, from the QKV stage);
* a buffer is written again (next layer, next stage) only by warps whose inputs already depend on
  every reader of its previous contents, so a reader never sees a newer tag than it waits for;
* the last block out advances the epoch (the next launch's tags).

Work inside a stage is split into warp units spread round-robin over all blocks (unit u: block
u mod grid): the row-vector's RMS statistics and the dot products are warp-shuffle reductions.
Attention takes one block per query head and merges its 64 lane groups in shared memory.

A spin that goes on too long (a bug, or a block that never got an SM) gives up and records where;
`stalls()` reads it (the step's logits are then wrong; the tests check it stays empty).

Limits (checked by `supported`): CUDA, bf16 weights, head_dim 64, hidden / q size / intermediate
multiples of 64, query heads a multiple of KV heads, a small model (`MAX_PREFETCH_WORDS`). Blocks
must be co-resident (one per SM, no other persistent kernel on the GPU at the same time). The engine
runs it as the batch-1 decode variant "mega", by name (`EngineConfig.decode_kernels="mega"`).
"""

from __future__ import annotations

from typing import Any

import torch

_SRC = r"""
#define WARPS 8
#define NT (WARPS * 32)
typedef unsigned int u32;
typedef unsigned short u16;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 f2bf(float f) {
  u32 u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ float rbf(float f) { return __uint_as_float(f2bf(f) << 16); }
// constant data (weights, cached K/V of earlier steps): volatile asm, so that a load written before
// a wait is issued before it (the compiler may move a plain or __ldg load past the spin loop)
__device__ __forceinline__ u32 ldnc(const u32* p) {
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void ldnc4(const u32* p, u32* o) {
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3]) : "l"(p));
}
__device__ __forceinline__ float ldnc_f(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
// tagged words (value << 16 | tag) written in this kernel: read from L2, written to L2; a word's
// value and tag arrive together (one 32-bit access), so no fence or flag is needed
__device__ __forceinline__ uint2 ld2(const u32* p) {
  uint2 v;
  asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld1(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st1(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acq(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 tagged(float v, u32 tag) { return (f2bf(v) << 16) | tag; }
__device__ __forceinline__ bool has(u32 w, u32 tag) { return (w & 0xffffu) == tag; }
__device__ __forceinline__ float val(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
#if TIMING
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// per warp (lane 0): tbuf[stage][block][warp][k]
#define STAMP(idx, k) \
  if ((threadIdx.x & 31) == 0) tbuf[(((idx) * GRID + blockIdx.x) * WARPS + (threadIdx.x >> 5)) * 3 + (k)] = gtime()
#else
#define STAMP(idx, k)
#endif

// a spin of a warp has gone on too long (a bug, or a block that never got an SM): record where
// (stall[0..3]: layer * 8 + stage + 1, the tag waited for, the word seen, block) and give up; once
// one warp gave up, every other gives up at its next check. The host reads it (`stalls`).
__device__ __noinline__ bool give_up(unsigned long long n, u32* stall, u32 where, u32 tag, u32 seen) {
  if (n > SPIN_LIMIT || ld_acq(stall) != 0u) {
    if ((threadIdx.x & 31) == 0 && atomicCAS(stall, 0u, where) == 0u) {
      stall[1] = tag; stall[2] = seen; stall[3] = blockIdx.x;
    }
    return true;
  }
  return false;
}

// poll a tagged row vector of K elements until every word carries `tag`: lane l gets elements
// 2(l + 32 j), +1 (as the weight rows are read, one u32 of two bf16 per j)
template <int K>
__device__ __forceinline__ void poll_row(const u32* buf, u32 tag, float* xs, u32* stall, u32 where) {
  const int lane = threadIdx.x & 31;
  // first spin on the row's last 256 bytes only (one request per round: a thousand warps
  // re-reading whole rows flood L2 and delay the very stores they wait for; units are dealt out
  // in order, so the last elements come from a warp's last unit), then read it all
  for (unsigned long long n = 1;; n++) {
    uint2 v = ld2(buf + 2 * (lane + 32 * (K / 64 - 1)));
    bool ok = has(v.x, tag) & has(v.y, tag);
    if (__all_sync(0xffffffffu, ok)) break;
    if ((n & 255u) == 0 && give_up(n, stall, where, tag, v.x)) break;
  }
  for (unsigned long long n = 1;; n++) {
    bool ok = true;
    u32 seen = tag;
#pragma unroll
    for (int j = 0; j < K / 64; j++) {
      uint2 v = ld2(buf + 2 * (lane + 32 * j));
      bool g = has(v.x, tag) & has(v.y, tag);
      if (!g) seen = v.x;
      ok &= g;
      xs[2 * j] = val(v.x);
      xs[2 * j + 1] = val(v.y);
    }
    if (__all_sync(0xffffffffu, ok)) return;
    if ((n & 255u) == 0 && give_up(n, stall, where, tag, seen)) return;
  }
}
// the block's polling: warp 0 alone spins on the row's last 256 bytes (`span`); the block's other
// `nwarps - 1` warps that take part in the stage sleep at the stage's named barrier until it is there. A
// thousand warps polling L2 measured 2-7 us hand-offs; one per block brings it to what a counter
// costs. Each warp then reads (and checks) the whole row itself.
template <int BAR>  // a named barrier per stage: a warp with no unit in one stage may reach the next one's
__device__ __forceinline__ void block_gate(const u32* span, u32 tag, int nwarps, u32* stall, u32 where) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    for (unsigned long long n = 1;; n++) {
      uint2 v = ld2(span + 2 * lane);
      if (__all_sync(0xffffffffu, has(v.x, tag) & has(v.y, tag))) break;
      if ((n & 255u) == 0 && give_up(n, stall, where, tag, v.x)) break;
    }
  }
  if (nwarps > 1) asm volatile("bar.sync %0, %1;" :: "n"(BAR), "r"(nwarps * 32) : "memory");
}
#define GATE_WARPS(U) min(WARPS, ((U) - b + GRID - 1) / GRID)
#define LAST_SPAN(buf, K) ((buf) + 2 * 32 * ((K) / 64 - 1))

// one tagged word (lane 0 only)
__device__ __forceinline__ float poll_one(const u32* p, u32 tag, u32* stall, u32 where) {
  for (unsigned long long n = 1;; n++) {
    u32 w = ld1(p);
    if (has(w, tag)) return val(w);
    if ((n & 255u) == 0 && give_up(n, stall, where, tag, w)) return val(w);
  }
}
// an untagged bf16 row written before the kernel (the embedding): same lane layout
template <int K>
__device__ __forceinline__ void load_plain(const u16* x, float* xs) {
  const u32* w = (const u32*)x;
#pragma unroll
  for (int j = 0; j < K / 64; j++) {
    u32 v = ldnc(w + (threadIdx.x & 31) + 32 * j);
    xs[2 * j] = bf_lo(v);
    xs[2 * j + 1] = bf_hi(v);
  }
}
template <int K>
__device__ __forceinline__ void rms_norm(float* xs, const u32* nwr) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < K / 32; i++) ss += xs[i] * xs[i];
  ss = warp_sum(ss);
  float rstd = rsqrtf(ss / K + EPS);
#pragma unroll
  for (int j = 0; j < K / 64; j++) {
    u32 g = nwr[j];
    xs[2 * j] = rbf(rbf(xs[2 * j] * rstd) * bf_lo(g));
    xs[2 * j + 1] = rbf(rbf(xs[2 * j + 1] * rstd) * bf_hi(g));
  }
}
template <int K>
__device__ __forceinline__ void load_row(const u16* w, long row, u32* regs) {
  const u32* p = (const u32*)w + row * (K / 2);
#pragma unroll
  for (int j = 0; j < K / 64; j++) regs[j] = ldnc(p + (threadIdx.x & 31) + 32 * j);
}
template <int K>
__device__ __forceinline__ float dot(const u32* regs, const float* xs) {
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < K / 64; j++) a += bf_lo(regs[j]) * xs[2 * j] + bf_hi(regs[j]) * xs[2 * j + 1];
  return a;
}

#define UNITS_PER_WARP(U) ((((U) + GRID - 1) / GRID + WARPS - 1) / WARPS)

extern "C" __global__ void __launch_bounds__(NT, 1)
mega_decode(const long long* ptrs, const u16* h_in, u32* xr, u32* r1, u32* qb, u32* kvn, u32* att, u32* act,
            const int* positions, const int* slots, const int* block_tables, const int* ctx_lens,
            const float* cos_sin, const u16* final_norm, const u16* head_w, float* logits, u32* ctl,
            u32* stall, unsigned long long* tbuf) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x;
  __shared__ float sm_m[64], sm_l[64], sm_acc[64][64];
  const int pos = positions[0];
  const long slot = slots[0];
  const int ctx = ctx_lens[0];
  const u32 epoch = ctl[0];
#define TAG(L, s) ((epoch * (u32)(NL * 5 + 1) + (u32)((L) * 5 + (s)) + 1u) & 0xffffu)

#pragma unroll 1
  for (int L = 0; L < NL; L++) {
    const long long* P = ptrs + L * 10;
    const u16* wqkv = (const u16*)P[0];
    const u16* bqkv = (const u16*)P[1];
    const u16* n_in = (const u16*)P[2];
    const u16* wo = (const u16*)P[3];
    const u16* n_post = (const u16*)P[4];
    const u16* wgu = (const u16*)P[5];
    const u16* wd = (const u16*)P[6];
    u16* kc = (u16*)P[7];
    u16* vc = (u16*)P[8];
    const u32 t_in = TAG(L - 1, 4), t_qkv = TAG(L, 0), t_att = TAG(L, 1), t_o = TAG(L, 2), t_gu = TAG(L, 3),
              t_out = TAG(L, 4);

    // ---- stage 0: norm + QKV + RoPE + K/V store; unit = a row pair (d, d + HD/2) of one head.
    // q goes to qb, the new k and v to the cache and to kvn (tagged, for this step's attention)
    {
      constexpr int U = (NH + 2 * NKV) * (HD / 2);
      constexpr int KU = UNITS_PER_WARP(U);
      const int u0 = b + GRID * warp;
      if (u0 < U) {
        u32 w1[KU][H / 64], w2[KU][H / 64];
        float cs_c[KU], cs_s[KU];
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            int hh = u / (HD / 2), d = u % (HD / 2);
            load_row<H>(wqkv, hh * HD + d, w1[k]);
            load_row<H>(wqkv, hh * HD + d + HD / 2, w2[k]);
            cs_c[k] = ldnc_f(cos_sin + pos * HD + d);
            cs_s[k] = ldnc_f(cos_sin + pos * HD + HD / 2 + d);
          }
        }
        u32 nwr[H / 64];
        load_row<H>(n_in, 0, nwr);
        STAMP(L * 5 + 0, 0);
        float xs[H / 32];
        if (L == 0) {
          load_plain<H>(h_in, xs);
        } else {
          block_gate<1>(LAST_SPAN(xr, H), t_in, GATE_WARPS(U), stall, L * 8 + 1);
          poll_row<H>(xr, t_in, xs, stall, L * 8 + 1);
        }
        STAMP(L * 5 + 0, 1);
        rms_norm<H>(xs, nwr);
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            int hh = u / (HD / 2), d = u % (HD / 2);
            float a1 = warp_sum(dot<H>(w1[k], xs)), a2 = warp_sum(dot<H>(w2[k], xs));
            if (lane == 0) {
#if HAS_BIAS
              a1 += __uint_as_float(((u32)bqkv[hh * HD + d]) << 16);
              a2 += __uint_as_float(((u32)bqkv[hh * HD + d + HD / 2]) << 16);
#endif
              float x1 = rbf(a1), x2 = rbf(a2);
              if (hh < NH + NKV) {
                float c = cs_c[k], s = cs_s[k];
                float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
                if (hh < NH) {
                  st1(qb + hh * HD + d, tagged(y1, t_qkv));
                  st1(qb + hh * HD + d + HD / 2, tagged(y2, t_qkv));
                } else {
                  int kh = hh - NH;
                  if (slot >= 0) {
                    u16* dst = kc + (slot * NKV + kh) * HD;
                    dst[d] = (u16)f2bf(y1);
                    dst[d + HD / 2] = (u16)f2bf(y2);
                  }
                  st1(kvn + kh * HD + d, tagged(y1, t_qkv));
                  st1(kvn + kh * HD + d + HD / 2, tagged(y2, t_qkv));
                }
              } else {
                int vh = hh - NH - NKV;
                if (slot >= 0) {
                  u16* dst = vc + (slot * NKV + vh) * HD;
                  dst[d] = (u16)f2bf(x1);
                  dst[d + HD / 2] = (u16)f2bf(x2);
                }
                st1(kvn + (NKV + vh) * HD + d, tagged(x1, t_qkv));
                st1(kvn + (NKV + vh) * HD + d + HD / 2, tagged(x2, t_qkv));
              }
            }
          }
        }
#if STORE_FENCE
        if (lane == 0) __threadfence();  // push this warp's tagged stores out to L2 now
#endif
        STAMP(L * 5 + 0, 2);
      }
    }

    // ---- stage 1: attention, one block per query head. Lane group grp = warp * 8 + lane / 4 (64 of
    // them) takes positions grp + 64 i, its 4 lanes 16 dims each; online softmax per group, the 64
    // groups merged through shared memory. Cached positions of the first PA rounds (all but the
    // newest, which comes from kvn) are loaded before the poll.
    if (b < NH) {
      const int kvh = b / (NH / NKV);
      const int sub = lane & 3, grp = warp * 8 + (lane >> 2);
      u32 kpre[PA][8], vpre[PA][8];
#pragma unroll
      for (int i = 0; i < PA; i++) {
        int p = grp + 64 * i;
        if (p < ctx - 1) {
          long sl = (long)block_tables[p / PAGE] * PAGE + p % PAGE;
          const u32* kr = (const u32*)(kc + (sl * NKV + kvh) * HD + sub * 16);
          const u32* vr = (const u32*)(vc + (sl * NKV + kvh) * HD + sub * 16);
          ldnc4(kr, kpre[i]); ldnc4(kr + 4, kpre[i] + 4);
          ldnc4(vr, vpre[i]); ldnc4(vr + 4, vpre[i] + 4);
        }
      }
      STAMP(L * 5 + 1, 0);
      // this head's q and its KV head's new k, v: 16 dims per lane (as 8 words of two bf16)
      float qv[16];
      u32 kn[8], vn[8];
      {
        const u32* qsrc = qb + b * HD + sub * 16;
        const u32* ksrc = kvn + kvh * HD + sub * 16;
        const u32* vsrc = kvn + (NKV + kvh) * HD + sub * 16;
        for (unsigned long long n = 1;; n++) {  // spin on one word per lane first (see poll_row)
          u32 w = ld1((lane & 1 ? vsrc : ksrc) + (lane >> 1));  // k/v rows: the later units
          if (__all_sync(0xffffffffu, has(w, t_qkv))) break;
          if ((n & 255u) == 0 && give_up(n, stall, L * 8 + 2, t_qkv, w)) break;
        }
        for (unsigned long long n = 1;; n++) {
          bool ok = true;
          u32 seen = t_qkv;
#pragma unroll
          for (int j = 0; j < 8; j++) {
            uint2 a = ld2(qsrc + 2 * j), kk = ld2(ksrc + 2 * j), vv = ld2(vsrc + 2 * j);
            bool g = has(a.x, t_qkv) & has(a.y, t_qkv) & has(kk.x, t_qkv) & has(kk.y, t_qkv) &
                     has(vv.x, t_qkv) & has(vv.y, t_qkv);
            if (!g) seen = a.x;
            ok &= g;
            qv[2 * j] = val(a.x) * (SCALE_LOG2E);
            qv[2 * j + 1] = val(a.y) * (SCALE_LOG2E);
            kn[j] = (kk.x >> 16) | (kk.y & 0xffff0000u);
            vn[j] = (vv.x >> 16) | (vv.y & 0xffff0000u);
          }
          if (__all_sync(0xffffffffu, ok)) break;
          if ((n & 255u) == 0 && give_up(n, stall, L * 8 + 2, t_qkv, seen)) break;
        }
      }
      STAMP(L * 5 + 1, 1);
      float m = NEG_INF, l = 0.f, acc[16];
#pragma unroll
      for (int i = 0; i < 16; i++) acc[i] = 0.f;
      // the trip count is the block's: every lane reaches the shuffles
      for (int base = 0; base < ctx; base += 64 * PA) {
#pragma unroll
        for (int i = 0; i < PA; i++) {
          const int p = base + grp + 64 * i;
          const bool valid = p < ctx;
          u32 kw[8], vw[8];
          if (p == ctx - 1) {
#pragma unroll
            for (int j = 0; j < 8; j++) { kw[j] = kn[j]; vw[j] = vn[j]; }
          } else if (base == 0 && valid) {
#pragma unroll
            for (int j = 0; j < 8; j++) { kw[j] = kpre[i][j]; vw[j] = vpre[i][j]; }
          } else if (valid) {
            long sl = (long)block_tables[p / PAGE] * PAGE + p % PAGE;
            const u32* kr = (const u32*)(kc + (sl * NKV + kvh) * HD + sub * 16);
            const u32* vr = (const u32*)(vc + (sl * NKV + kvh) * HD + sub * 16);
            ldnc4(kr, kw); ldnc4(kr + 4, kw + 4);
            ldnc4(vr, vw); ldnc4(vr + 4, vw + 4);
          } else {
#pragma unroll
            for (int j = 0; j < 8; j++) { kw[j] = 0u; vw[j] = 0u; }
          }
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < 8; j++) s += bf_lo(kw[j]) * qv[2 * j] + bf_hi(kw[j]) * qv[2 * j + 1];
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          if (valid) {
            float mn = fmaxf(m, s);
            float a = exp2f(m - mn), e = exp2f(s - mn);
            l = l * a + e;
#pragma unroll
            for (int j = 0; j < 8; j++) {
              acc[2 * j] = acc[2 * j] * a + e * bf_lo(vw[j]);
              acc[2 * j + 1] = acc[2 * j + 1] * a + e * bf_hi(vw[j]);
            }
            m = mn;
          }
        }
      }
      if (sub == 0) { sm_m[grp] = m; sm_l[grp] = l; }
#pragma unroll
      for (int i = 0; i < 16; i++) sm_acc[grp][sub * 16 + i] = acc[i];
      __syncthreads();
      {  // thread (part, d): dim d over groups 16 part .. 16 part + 15; then the 4 parts per dim
        const int d = threadIdx.x & 63, part = threadIdx.x >> 6;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < 64; w++) M = fmaxf(M, sm_m[w]);
        float Ls = 0.f, o = 0.f;
#pragma unroll
        for (int w = 16 * part; w < 16 * part + 16; w++) {
          float f = sm_m[w] == NEG_INF ? 0.f : exp2f(sm_m[w] - M);
          Ls += sm_l[w] * f;
          o += sm_acc[w][d] * f;
        }
        __syncthreads();  // the partial sums reuse the groups' rows
        sm_acc[part][d] = o;
        if (d == 0) sm_l[part] = Ls;
        __syncthreads();
        if (threadIdx.x < HD) {
          float lt = sm_l[0] + sm_l[1] + sm_l[2] + sm_l[3];
          float ot = sm_acc[0][d] + sm_acc[1][d] + sm_acc[2][d] + sm_acc[3][d];
          st1(att + b * HD + d, tagged(lt > 0.f ? ot / lt : 0.f, t_att));
        }
        __syncthreads();  // shared memory is reused by the next layer's attention
      }
#if STORE_FENCE
      if (threadIdx.x < HD) __threadfence();
#endif
      STAMP(L * 5 + 1, 2);
    }

    // ---- stage 2: O projection + residual; unit = one output row
    {
      constexpr int U = H;
      constexpr int KU = UNITS_PER_WARP(U);
      const int u0 = b + GRID * warp;
      if (u0 < U) {
        u32 w[KU][QS / 64];
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) load_row<QS>(wo, u, w[k]);
        }
        STAMP(L * 5 + 2, 0);
        float xs[QS / 32], res[KU];
        block_gate<2>(LAST_SPAN(att, QS), t_att, GATE_WARPS(U), stall, L * 8 + 3);
        poll_row<QS>(att, t_att, xs, stall, L * 8 + 3);
        STAMP(L * 5 + 2, 1);
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          res[k] = 0.f;
          if (lane == 0 && u < U)
            res[k] = L == 0 ? __uint_as_float(((u32)h_in[u]) << 16) : poll_one(xr + u, t_in, stall, L * 8 + 3);
        }
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            float a = warp_sum(dot<QS>(w[k], xs));
            if (lane == 0) st1(r1 + u, tagged(rbf(a) + res[k], t_o));
          }
        }
#if STORE_FENCE
        if (lane == 0) __threadfence();  // push this warp's tagged stores out to L2 now
#endif
        STAMP(L * 5 + 2, 2);
      }
    }

    // ---- stage 3: norm + gate|up + SiLU·up; unit = intermediate index i (rows i and I + i)
    {
      constexpr int U = INTER;
      constexpr int KU = UNITS_PER_WARP(U);
      const int u0 = b + GRID * warp;
      if (u0 < U) {
        u32 wg[KU][H / 64], wu[KU][H / 64];
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            load_row<H>(wgu, u, wg[k]);
            load_row<H>(wgu, INTER + u, wu[k]);
          }
        }
        u32 nwr[H / 64];
        load_row<H>(n_post, 0, nwr);
        STAMP(L * 5 + 3, 0);
        float xs[H / 32];
        block_gate<3>(LAST_SPAN(r1, H), t_o, GATE_WARPS(U), stall, L * 8 + 4);
        poll_row<H>(r1, t_o, xs, stall, L * 8 + 4);
        STAMP(L * 5 + 3, 1);
        rms_norm<H>(xs, nwr);
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            float gs = rbf(warp_sum(dot<H>(wg[k], xs))), us = rbf(warp_sum(dot<H>(wu[k], xs)));
            if (lane == 0) st1(act + u, tagged(rbf(gs / (1.f + __expf(-gs))) * us, t_gu));
          }
        }
#if STORE_FENCE
        if (lane == 0) __threadfence();  // push this warp's tagged stores out to L2 now
#endif
        STAMP(L * 5 + 3, 2);
      }
    }

    // ---- stage 4: down projection + residual; unit = one output row
    {
      constexpr int U = H;
      constexpr int KU = UNITS_PER_WARP(U);
      const int u0 = b + GRID * warp;
      if (u0 < U) {
        u32 w[KU][INTER / 64];
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) load_row<INTER>(wd, u, w[k]);
        }
        STAMP(L * 5 + 4, 0);
        float xs[INTER / 32], res[KU];
        block_gate<4>(LAST_SPAN(act, INTER), t_gu, GATE_WARPS(U), stall, L * 8 + 5);
        poll_row<INTER>(act, t_gu, xs, stall, L * 8 + 5);
        STAMP(L * 5 + 4, 1);
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          res[k] = (lane == 0 && u < U) ? poll_one(r1 + u, t_o, stall, L * 8 + 5) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < KU; k++) {
          int u = u0 + GRID * WARPS * k;
          if (u < U) {
            float a = warp_sum(dot<INTER>(w[k], xs));
            if (lane == 0) st1(xr + u, tagged(rbf(a) + res[k], t_out));
          }
        }
#if STORE_FENCE
        if (lane == 0) __threadfence();  // push this warp's tagged stores out to L2 now
#endif
        STAMP(L * 5 + 4, 2);
      }
    }
  }

  // ---- final norm + output projection (float32 logits); 4 rows in flight per warp
  {
    constexpr int G = 4;
    const int gw = b + GRID * warp;  // rows gw + GRID*WARPS*(G*it + k)
    constexpr int STRIDE = GRID * WARPS;
    u32 w[G][H / 64];
#pragma unroll
    for (int k = 0; k < G; k++) {
      long row = gw + (long)STRIDE * k;
      if (row < VOCAB) load_row<H>(head_w, row, w[k]);
    }
    u32 nwr[H / 64];
    load_row<H>(final_norm, 0, nwr);
    STAMP(NL * 5, 0);
    float xs[H / 32];
    block_gate<5>(LAST_SPAN(xr, H), TAG(NL - 1, 4), WARPS, stall, NL * 8 + 6);
    poll_row<H>(xr, TAG(NL - 1, 4), xs, stall, NL * 8 + 6);
    STAMP(NL * 5, 1);
    rms_norm<H>(xs, nwr);
    for (long base = gw; base < VOCAB; base += (long)STRIDE * G) {
      float a[G];
#pragma unroll
      for (int k = 0; k < G; k++) a[k] = dot<H>(w[k], xs);
#pragma unroll
      for (int k = 0; k < G; k++) {
        long row = base + (long)STRIDE * (G + k);
        if (row < VOCAB) load_row<H>(head_w, row, w[k]);
      }
#pragma unroll
      for (int k = 0; k < G; k++) {
        float s = warp_sum(a[k]);
        long row = base + (long)STRIDE * k;
        if (lane == 0 && row < VOCAB) logits[row] = s;
      }
    }
  }

  // ---- the last block out advances the epoch (the tags of the next launch)
  __syncthreads();
  STAMP(NL * 5, 2);
  if (threadIdx.x == 0) {
    __threadfence();
    u32 done = atomicAdd(ctl + 1, 1u);
    if (done == GRID - 1) {
      ctl[1] = 0u;
      ctl[0] = epoch + 1u;
      __threadfence();
    }
  }
}
"""

_cache: dict[tuple[Any, ...], Any] = {}


def supported(model: Any) -> str | None:
    """None when the model runs here, else why not."""
    cfg = model.cfg
    if model.device.type != "cuda":
        return "needs CUDA"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return "this torch has no torch.cuda._compile_kernel (NVRTC)"
    if model.embed_tokens.dtype != torch.bfloat16:
        return f"bf16 weights only, not {model.embed_tokens.dtype}"
    if cfg.head_dim != 64:
        return f"head_dim 64 only, not {cfg.head_dim}"
    if cfg.num_heads % cfg.num_kv_heads:
        return "query heads must be a multiple of KV heads"
    for name, v in (("hidden", cfg.hidden_size), ("q size", cfg.q_size), ("intermediate", cfg.intermediate_size)):
        if v % 64:
            return f"{name} {v} is not a multiple of 64"
    grid = grid_for(model)
    if cfg.intermediate_size < 8 * grid:
        # every warp of every block then takes part in the gate|up stage, whose barrier keeps the
        # block's warps within one layer of each other (the named barriers of the stages rely on it)
        return f"intermediate {cfg.intermediate_size} < 8 warps x {grid} SMs"
    regs = prefetch_words(cfg, grid)
    if regs > MAX_PREFETCH_WORDS:
        return (f"a warp would hold {regs} weight words per lane ahead of a stage (> {MAX_PREFETCH_WORDS}): "
                "a model this size spills registers; the multi-kernel variants serve it")
    return None


MAX_PREFETCH_WORDS = 72
"""Weight words (2 bf16) per lane a warp may load ahead of one stage; SmolLM2-135M needs 36,
Llama-3.2-1B would need 512 (its gate|up stage alone: 8 units of 2 rows × 32 words)."""


def grid_for(model: Any) -> int:
    return int(torch.cuda.get_device_properties(model.device).multi_processor_count)


def prefetch_words(cfg: Any, grid: int) -> int:
    """The most weight words per lane any stage loads ahead of its wait (see the kernel)."""
    def ku(units: int) -> int:
        per_block = (units + grid - 1) // grid
        return (per_block + 7) // 8
    h, qs, inter = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    return max(ku((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2) * 2 * h // 64,
               ku(h) * qs // 64, ku(inter) * 2 * h // 64, ku(h) * inter // 64, 4 * h // 64)


def _kernel(model: Any, grid: int, page: int, timing: bool = False, store_fence: bool = False) -> Any:
    cfg = model.cfg
    vocab = model.head().weight.shape[0]
    has_bias = model.layers[0].qkv.bias is not None
    key = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, vocab,
           has_bias, float(cfg.rms_norm_eps), grid, page, model.device, timing, store_fence)
    k = _cache.get(key)
    if k is None:
        scale_log2e = (cfg.head_dim ** -0.5) * 1.4426950408889634
        defs = {"NL": cfg.num_layers, "H": cfg.hidden_size, "NH": cfg.num_heads, "NKV": cfg.num_kv_heads,
                "HD": cfg.head_dim, "QS": cfg.q_size, "INTER": cfg.intermediate_size, "VOCAB": vocab,
                "HAS_BIAS": int(has_bias), "EPS": f"{float(cfg.rms_norm_eps):.9e}f", "GRID": grid, "PAGE": page,
                "SCALE_LOG2E": f"{scale_log2e:.9e}f", "SPIN_LIMIT": "(1ull << 22)", "TIMING": int(timing), "PA": 3, "STORE_FENCE": int(store_fence)}
        src = "".join(f"#define {n} {v}\n" for n, v in defs.items()) + _SRC
        with torch.cuda.device(model.device):
            k = torch.cuda._compile_kernel(src, "mega_decode")
        _cache[key] = k
    return k


class _State:
    """Per-model buffers of the kernel: the layer pointer table, tagged activations, epoch, stall record."""

    def __init__(self, model: Any, attention: Any) -> None:
        cfg, dev = model.cfg, model.device
        rows = []
        for i, layer in enumerate(model.layers):
            kc, vc = attention.cache.flat(i)
            b = layer.qkv.bias
            rows.append([layer.qkv.weight.data_ptr(), 0 if b is None else b.data_ptr(), layer.input_norm.data_ptr(),
                         layer.o.weight.data_ptr(), layer.post_norm.data_ptr(), layer.gate_up.weight.data_ptr(),
                         layer.down.weight.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0])
        self.ptrs = torch.tensor([r for row in rows for r in row], dtype=torch.int64, device=dev)
        words = {"xr": cfg.hidden_size, "r1": cfg.hidden_size, "qb": cfg.q_size,
                 "kvn": 2 * cfg.num_kv_heads * cfg.head_dim, "att": cfg.q_size, "act": cfg.intermediate_size}
        # tagged activation words (value << 16 | tag), zero: tag 0, which no launch waits for
        self.bufs = [torch.zeros(n, dtype=torch.int32, device=dev) for n in words.values()]
        self.ctl = torch.zeros(2, dtype=torch.int32, device=dev)  # launch epoch, blocks finished
        self.stall = torch.zeros(4, dtype=torch.int32, device=dev)
        self.grid = grid_for(model)
        # keep what the table points at alive as long as the table
        self.refs = (model, attention.cache)


def decode_logits_mega(model: Any, h: torch.Tensor, attention: Any, timing: torch.Tensor | None = None,
                       store_fence: bool = False) -> torch.Tensor:
    """Batch-1 decode forward of `h` [1, hidden] (the token's embedding) as one kernel → float32
    logits [1, vocab]. `attention` carries the step's device inputs as `graphs.TritonDecodeAttention`
    does (positions, slots, block_tables, ctx_lens, cache).

    `timing` (a profiling build): an int64 tensor of `timing_slots(model)` that receives the GPU
    global timer (ns) of each warp at each stage it takes part in: before its poll, after it, after its
    stores (see `bench/decode_mega_cuda.py`). `store_fence`: a `__threadfence` after each warp's stores
    of a stage (measured in the bench)."""
    if h.shape != (1, model.cfg.hidden_size) or h.dtype != torch.bfloat16:
        raise ValueError(f"mega kernel takes one bf16 row [1, {model.cfg.hidden_size}], got {tuple(h.shape)} {h.dtype}")
    st: _State | None = getattr(attention.cache, "_mega_state", None)
    if st is None or st.refs[0] is not model:  # checked once per model and cache, not every step
        why = supported(model)
        if why is not None:
            raise ValueError(f"mega kernel: {why}")
        st = _State(model, attention)
        attention.cache._mega_state = st
    kern = _kernel(model, st.grid, attention.cache.block_size, timing=timing is not None, store_fence=store_fence)
    vocab = model.head().weight.shape[0]
    logits = torch.empty(1, vocab, dtype=torch.float32, device=h.device)
    h = h.contiguous()
    kern(grid=(st.grid, 1, 1), block=(256, 1, 1),
         args=[st.ptrs, h, *st.bufs, attention.positions, attention.slots, attention.block_tables.contiguous(),
               attention.ctx_lens, model.cos_sin, model.norm, model.head().weight, logits, st.ctl, st.stall,
               timing if timing is not None else st.stall])
    return logits


def timing_slots(model: Any) -> int:
    """Entries of the `timing` tensor: (layers × 5 + 1 stages) × grid × 8 warps × 3."""
    return (model.cfg.num_layers * 5 + 1) * grid_for(model) * 8 * 3


def stalls(cache: Any) -> str | None:
    """None, or where the kernel run(s) on this KV cache gave up waiting since the last call (and
    reset the record). A stall means wrong logits for that step; it should never happen."""
    st: _State | None = getattr(cache, "_mega_state", None)
    if st is None:
        return None
    where, tag, seen, block = st.stall.tolist()
    if where == 0:
        return None
    st.stall.zero_()
    layer, stage = divmod(where - 1, 8)
    return (f"mega kernel stalled: block {block} waited at layer {layer} stage {stage} for tag {tag}, "
            f"saw word {seen & 0xFFFFFFFF:#010x}")
