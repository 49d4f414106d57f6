"""Overlapped decode (`EngineConfig.overlap`) produces the synchronous engine's outputs.

Each scenario drives two engines over the same tiny random model, one with overlap on and one
off, through the same script (requests that start, join when another sequence has produced n
tokens, cancels at a token count) and compares every sequence's outputs: token ids, finished
flags and finish reasons, in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import FinishReason, SamplingParams

Out = tuple[int | None, bool, FinishReason | None]
PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 13, 14, 15], [100, 101, 102], list(range(20, 60)),
           [7, 7, 9, 200, 3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    d: Path = tmp_path_factory.mktemp("tiny_overlap")
    tiny_hf_model("llama3", d, seed=11)
    return load_model(d)


def engine(model: LlamaModel, overlap: bool, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=4, num_blocks=96, max_prefill_tokens=512, overlap=overlap)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))  # type: ignore[arg-type]


@dataclasses.dataclass
class Trigger:
    """When sequence `after` has `n` outputs (None: at the start), call `action(engine, ids)`."""

    after: str | None
    n: int
    action: Callable[[LLMEngine, dict[str, int]], None]


def add(name: str, prompt: list[int], params: SamplingParams, priority: int = 0
        ) -> Callable[[LLMEngine, dict[str, int]], None]:
    def act(eng: LLMEngine, ids: dict[str, int]) -> None:
        ids[name] = eng.add_request(prompt, params, priority=priority)
    return act


def cancel(name: str) -> Callable[[LLMEngine, dict[str, int]], None]:
    def act(eng: LLMEngine, ids: dict[str, int]) -> None:
        eng.cancel(ids[name])
    return act


def drive(eng: LLMEngine, script: list[Trigger], max_steps: int = 400) -> dict[str, list[Out]]:
    """Run the script to completion; every sequence's outputs by name."""
    ids: dict[str, int] = {}
    outs: dict[str, list[Out]] = {}
    todo = list(script)
    for _ in range(max_steps):
        fired = [t for t in todo if t.after is None or len(outs.get(t.after, [])) >= t.n]
        for t in fired:
            t.action(eng, ids)
            todo.remove(t)
        names = {v: k for k, v in ids.items()}
        for o in eng.step():
            outs.setdefault(names[o.seq_id], []).append((o.token_id, o.finished, o.finish_reason))
        finished = {k for k, v in outs.items() if v and v[-1][1]}
        if not todo and finished == set(ids) and not eng.has_work():
            eng.blocks.check()
            assert eng.blocks.num_free == eng.blocks.num_blocks  # nothing leaked, extra writes freed
            return outs
    raise AssertionError(f"script did not finish in {max_steps} steps: {outs}")


def both(model: LlamaModel, script: list[Trigger], **kw: object) -> tuple[dict[str, list[Out]], LLMEngine]:
    """The script's outputs with overlap off and on (asserted equal), and the overlapped engine."""
    ref = drive(engine(model, False, **kw), script)
    eng = engine(model, True, **kw)
    got = drive(eng, script)
    assert got == ref
    return got, eng


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_steady_decode_overlaps_and_matches(model: LlamaModel) -> None:
    script = [Trigger(None, 0, add(f"s{i}", p, greedy(10 + 3 * i))) for i, p in enumerate(PROMPTS)]
    ref = drive(engine(model, False), script)
    eng = engine(model, True)
    assert eng.overlap is not None
    chain = eng.overlap.chain
    launch = chain.launch_greedy
    gathered: list[list[int]] = []

    def spy(seqs: list, prev: object, rows: list[int] | None = None) -> object:
        if rows is not None:
            gathered.append(rows)
        return launch(seqs, prev, rows)  # type: ignore[arg-type]

    chain.launch_greedy = spy  # type: ignore[method-assign,assignment]
    outs = drive(eng, script)
    assert outs == ref
    assert gathered == [[1, 2, 3], [1, 2], [1]]  # each time the first row reached its max_tokens
    assert [len(outs[f"s{i}"]) for i in range(4)] == [10, 13, 16, 19]
    assert all(o[2] is FinishReason.LENGTH for o in (v[-1] for v in outs.values()))
    # most decode steps ran one ahead; a sequence at its max_tokens left the batch run ahead
    # (known before its last token), so no token was computed in vain
    assert eng.stats.overlap_steps >= 15
    assert eng.stats.overlap_discarded == 0
    assert eng.overlap is not None and not eng.overlap.in_flight


def test_batch_one_every_step_after_the_first_two_overlaps(model: LlamaModel) -> None:
    outs, eng = both(model, [Trigger(None, 0, add("a", PROMPTS[0], greedy(20)))])
    assert len(outs["a"]) == 20
    # step 1 prefills, step 2 is the first decode (launched synchronously), 3..20 run ahead
    assert eng.stats.overlap_steps == 18 and eng.stats.steps == 20 and eng.stats.overlap_discarded == 0


def test_finish_by_eos_and_stop_mid_stream(model: LlamaModel) -> None:
    ref = engine(model, False).generate(PROMPTS[:2], greedy(16))
    eos, stop = ref[0][5], ref[1][3]
    script = [Trigger(None, 0, add("a", PROMPTS[0], SamplingParams(max_tokens=16))),
              Trigger(None, 0, add("b", PROMPTS[1], SamplingParams(max_tokens=16, stop_token_ids=(stop,)))),
              Trigger(None, 0, add("c", PROMPTS[2], SamplingParams(max_tokens=16)))]
    got: dict[bool, dict[str, list[Out]]] = {}
    for overlap in (False, True):
        eng = engine(model, overlap)
        eng.eos_ids = {eos}
        got[overlap] = drive(eng, script)
    assert got[True] == got[False]
    a, b = got[True]["a"], got[True]["b"]
    assert a[-1] == (eos, True, FinishReason.EOS) and len(a) == ref[0].index(eos) + 1
    assert b[-1] == (stop, True, FinishReason.STOP) and len(b) == ref[1].index(stop) + 1


def test_cancel_mid_stream(model: LlamaModel) -> None:
    script = [Trigger(None, 0, add("a", PROMPTS[0], greedy(30))),
              Trigger(None, 0, add("b", PROMPTS[1], greedy(30))),
              Trigger("a", 6, cancel("a")),
              Trigger("b", 11, cancel("b"))]
    outs, eng = both(model, script)
    assert outs["a"][-1] == (None, True, FinishReason.CANCELLED) and len(outs["a"]) == 7
    assert outs["b"][-1] == (None, True, FinishReason.CANCELLED) and len(outs["b"]) == 12
    assert eng.stats.cancelled == 2 and eng.stats.overlap_discarded == 2


def test_sequences_join_and_leave(model: LlamaModel) -> None:
    script = [Trigger(None, 0, add("a", PROMPTS[0], greedy(25))),
              Trigger("a", 3, add("b", PROMPTS[1], greedy(6))),
              Trigger("b", 4, add("c", PROMPTS[2], greedy(9))),
              Trigger("c", 9, add("d", PROMPTS[3], greedy(5))),
              Trigger("a", 15, add("e", PROMPTS[0] + [3], greedy(7)))]
    outs, eng = both(model, script)
    assert [len(outs[k]) for k in "abcde"] == [25, 6, 9, 5, 7]
    assert eng.stats.overlap_steps > 0


def test_preemption_under_block_pressure(model: LlamaModel) -> None:
    script = [Trigger(None, 0, add(f"s{i}", p, greedy(14), priority=i)) for i, p in enumerate(PROMPTS[:3])]
    outs, eng = both(model, script, num_blocks=16, enable_prefix_cache=False)
    assert eng.stats.preemptions > 0 and eng.stats.overlap_steps > 0
    assert [len(outs[f"s{i}"]) for i in range(3)] == [14, 14, 14]


def test_non_greedy_runs_synchronously_and_matches(model: LlamaModel) -> None:
    script = [Trigger(None, 0, add("a", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                                                                    ignore_eos=True))),
              Trigger(None, 0, add("b", PROMPTS[1], greedy(12)))]
    outs, eng = both(model, script)
    assert eng.stats.overlap_steps == 0  # a sampled sequence in the batch: no step runs ahead
    assert len(outs["a"]) == len(outs["b"]) == 12


def test_appends_and_prefix_hits_while_decoding(model: LlamaModel) -> None:
    def append(eng: LLMEngine, ids: dict[str, int]) -> None:
        eng.append(ids["ctx"], token_ids=[9, 8, 7, 6, 5])

    def start(eng: LLMEngine, ids: dict[str, int]) -> None:
        eng.start_generation(ids["ctx"], greedy(8))

    def open_ctx(eng: LLMEngine, ids: dict[str, int]) -> None:
        ids["ctx"] = eng.add_request(PROMPTS[2], generate=False)

    script = [Trigger(None, 0, add("a", PROMPTS[2] + [1, 2], greedy(20))),
              Trigger("a", 2, open_ctx), Trigger("a", 6, append), Trigger("a", 9, start),
              Trigger("ctx", 8, add("z", PROMPTS[2] + [1, 2], greedy(4)))]
    outs, eng = both(model, script)
    assert len(outs["ctx"]) == 8 and len(outs["z"]) == 4
    assert outs["z"] == outs["a"][:3] + [(outs["a"][3][0], True, FinishReason.LENGTH)]
    assert eng.stats.prefix_cached_tokens > 0


def test_has_work_while_a_step_is_in_flight(model: LlamaModel) -> None:
    eng = engine(model, True)
    sid = eng.add_request(PROMPTS[1], greedy(4))
    seen: list[int] = []
    while eng.has_work():
        seen += [o.token_id for o in eng.step() if o.seq_id == sid and o.token_id is not None]
    assert len(seen) == 4 and eng.overlap is not None and not eng.overlap.in_flight
    assert seen == engine(model, False).generate([PROMPTS[1]], greedy(4))[0]


def test_kv_budget_evictions_between_overlapped_steps(model: LlamaModel) -> None:
    from tristream.engine.kv_retention import RetentionConfig

    script = [Trigger(None, 0, add("a", list(range(3, 23)), greedy(30))),
              Trigger(None, 0, add("b", PROMPTS[1], greedy(30)))]
    outs, eng = both(model, script, kv_budget_tokens=24,
                     retention=RetentionConfig(sink_tokens=4, text_window_tokens=8))
    assert eng.stats.retention.evictions > 0 and eng.stats.overlap_steps > 0
    assert len(outs["a"]) == len(outs["b"]) == 30


def test_an_external_scheduler_is_never_run_ahead_of(model: LlamaModel) -> None:
    """With `allow` (a scheduler planning each step) the engine never launches a step ahead, so an
    empty plan (`step(allow=set())`, which the scheduled server discards) loses no tokens."""
    eng = engine(model, overlap=True)
    sid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    got: list[int | None] = []
    for _ in range(40):
        got += [o.token_id for o in eng.step(allow={sid})]
        assert not eng.step(allow=set())  # nothing in flight to hand over
        if not eng.has_work():
            break
    assert eng.stats.overlap_steps == 0
    ref = engine(model, overlap=False)
    rid = ref.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    want: list[int | None] = []
    while ref.has_work():
        want += [o.token_id for o in ref.step(allow={rid})]
    assert got == want and len([t for t in got if t is not None]) == 12


def test_overlap_none_means_cuda_only(model: LlamaModel) -> None:
    eng = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=32, overlap=None))
    assert eng.config.overlap is False and eng.overlap is None  # CPU model
