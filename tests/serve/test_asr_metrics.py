"""The CPU streaming recogniser's counters reach `/metrics` (what `bench/e2e_cpu.py` records per run)."""

from __future__ import annotations

from tristream.serve.speech_stages import asr_stream_families
from tristream.stages.asr_stream import StreamStats


class _Recogniser:
    def __init__(self) -> None:
        self.stats = StreamStats(updates=7, finals=2, tail_redecodes=1, decode_s=0.25)


def test_stream_stats_become_one_family_of_named_gauges() -> None:
    fams = asr_stream_families(_Recogniser())
    assert [f[0] for f in fams] == ["tristream_asr_counter"]
    rows = {labels["name"]: value for _, labels, value in fams[0][3]}
    assert rows["updates"] == 7 and rows["finals"] == 2 and rows["tail_redecodes"] == 1
    assert rows["decode_s"] == 0.25 and rows["speculation_hits"] == 0


def test_a_recogniser_without_stream_stats_adds_nothing() -> None:
    assert asr_stream_families(object()) == []
    assert asr_stream_families(type("R", (), {"stats": StreamStats})()) == []  # a class, not counters
