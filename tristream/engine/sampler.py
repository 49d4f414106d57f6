"""On-device token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeds.

Randomness is counter-based: the noise for (seed, step, token) comes from an integer hash, so
a request with a seed draws the same tokens whatever batch it shares and whatever ran before,
with no generator state and no host sync. Sampling is the Gumbel-max trick on the filtered
distribution (argmax of p / Exp(1) noise), which equals drawing from p.
"""

from __future__ import annotations

import dataclasses

import torch

from tristream.engine.sequence import SamplingParams

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)  # golden ratio, as signed int64
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row of [rows, vocab] logits (first index on ties): one Triton kernel on
    CUDA (`kernels/argmax.py`; torch's one-block reduction took 14 µs for a 49k vocab), torch
    elsewhere."""
    if logits.is_cuda and logits.dim() == 2:
        from tristream.engine.kernels.argmax import greedy_tokens as triton_greedy

        return triton_greedy(logits)
    return logits.argmax(dim=-1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping multiply; logical shifts emulated)."""
    mask = (1 << 63) - 1
    x = x ^ ((x >> 30) & (mask >> 29))
    x = x * _M2
    x = x ^ ((x >> 27) & (mask >> 26))
    x = x * _M3
    x = x ^ ((x >> 31) & (mask >> 30))
    return x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, vocab], a pure function of (seed, step, token index)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    base = _mix(seeds.to(torch.int64) * _M1 + steps.to(torch.int64))
    x = _mix(base[:, None] + idx[None, :] * _M1)
    mant = (x >> 40) & ((1 << 24) - 1)  # 24 random bits
    return (mant.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclasses.dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 (tokens generated so far)
    all_greedy: bool
    need_filter: bool
    penalty: torch.Tensor | None = None  # [B] float32, when any row uses one
    history: torch.Tensor | None = None  # [B, H] int64 previous token ids, -1 padded

    @staticmethod
    def build(
        params: list[SamplingParams], steps: list[int], seeds: list[int],
        histories: list[list[int]] | None, device: torch.device | str,
    ) -> SamplingBatch:
        temps = [p.temperature for p in params]
        all_greedy = all(t == 0 for t in temps)
        need_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in params if p.temperature > 0)
        use_pen = any(p.repetition_penalty != 1.0 for p in params) and histories is not None
        pen = hist = None
        if use_pen:
            assert histories is not None
            width = max(1, max(len(h) for h in histories))
            hist = torch.full((len(params), width), -1, dtype=torch.int64)
            for i, h in enumerate(histories):
                if h:  # pad with a token of the row so duplicate scatter targets agree
                    hist[i, :] = h[0]
                    hist[i, :len(h)] = torch.tensor(h, dtype=torch.int64)
            hist = hist.to(device, non_blocking=True)
            pen = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            steps=torch.tensor(steps, dtype=torch.int64, device=device),
            all_greedy=all_greedy, need_filter=need_filter, penalty=pen, history=hist,
        )


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style penalty: logits of seen tokens divided by p if positive, multiplied if negative."""
    valid = history >= 0
    idx = history.clamp(min=0)
    seen = logits.gather(1, idx)
    pen = penalty[:, None]
    new = torch.where(seen > 0, seen / pen, seen * pen)
    new = torch.where(valid, new, seen)
    out = logits.clone()
    out.scatter_(1, idx, new)
    return out


def apply_logits_masks(logits: torch.Tensor, masks: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """`logits` [B, vocab] with each listed row (row, bool mask of allowed tokens) kept to its
    allowed tokens (the others -inf); a mask shorter than the vocab forbids the ids past it."""
    out = logits.clone()
    for row, allowed in masks:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        n = min(int(allowed.shape[0]), logits.shape[-1])
        keep[:n] = allowed[:n].to(logits.device)
        out[row].masked_fill_(~keep, float("-inf"))
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [B] (int64, on logits' device) for float32 logits [B, vocab]."""
    if batch.penalty is not None and batch.history is not None:
        logits = apply_repetition_penalty(logits, batch.history, batch.penalty)
    greedy = greedy_tokens(logits)
    if batch.all_greedy:
        return greedy
    temp = batch.temperature.clamp(min=1e-5)[:, None]
    scaled = logits / temp
    if batch.need_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))[:, None]
        remove = ranks >= k
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        remove |= (cum - probs) > batch.top_p[:, None]  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    noise = uniform_noise(batch.seeds, batch.steps, logits.shape[-1])
    exp_noise = -torch.log(noise)
    drawn = (probs / exp_noise).argmax(dim=-1)
    return torch.where(batch.temperature > 0, drawn, greedy)
