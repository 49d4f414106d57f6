"""Answer quality of the assistant: everyday questions asked in one conversation.

Default: starts `tristream serve --token T` (plus any `--serve-arg`), connects over a real
WebSocket, sets ``modalities: ["text"]`` and asks every question as a text turn
(``conversation.item.create`` + ``response.create``) in one session, so the history of the
earlier answers is in the prompt, as it is for a user. ``--direct`` runs the same prompt module
on an in-process engine (no server; quick prompt iteration). An answer counts as correct when
it matches the question's accepted-answer pattern (case-insensitive regular expression).

    .venv/bin/python bench/assistant.py                       # the default server
    .venv/bin/python bench/assistant.py --serve-arg=--quant --serve-arg=none
    .venv/bin/python bench/assistant.py --direct --quant none

Prints a table and writes `bench/results/assistant.json` (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _common import ServerDidNotStart, cpu_info, free_port, git_commit, stop_process, wait_healthy  # noqa: E402

QUESTIONS: list[tuple[str, ...]] = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What is the capital of Germany?", r"\bberlin\b"),
    ("How many days are in a year?", r"\b365\b|three hundred (and )?sixty[- ]five"),
    ("How many legs does a spider have?", r"\b(8|eight) legs\b"),
    ("How many legs does a dog have?", r"\b(4|four) legs\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("What color are bananas when they are ripe?", r"\byellow\b"),
    ("What do bees make?", r"\bhoney\b"),
    ("What is the largest ocean on Earth?", r"\bpacific\b"),
    ("Which planet do we live on?", r"\bearth\b", r"\b(jupiter|mars|venus|saturn)\b"),
    ("What is the closest star to Earth?", r"\bsun\b", r"\bproxima\b"),
    ("What gas do people need to breathe?", r"\boxygen\b"),
    ("What is frozen water called?", r"\bice\b"),
    ("At what temperature in Celsius does water freeze?", r"\b(0|zero)\b"),
    ("How many hours are in a day?", r"\b(24|twenty[- ]four)\b"),
    ("How many minutes are in an hour?", r"\b(60|sixty)\b"),
    ("What is two plus two?", r"\b(4|four)\b"),
    ("Which animal is known as the king of the jungle?", r"\blions?\b"),
    ("What do cows drink?", r"\bwater\b"),
    ("What is the opposite of hot?", r"\bcold\b"),
    ("What language is spoken in Spain?", r"\bspanish\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("What is the tallest animal in the world?", r"\bgiraffes?\b"),
    ("Which season comes after winter?", r"\bspring\b"),
    ("What do you call a baby cat?", r"\bkittens?\b"),
    ("What is the main ingredient of bread?", r"\b(flour|wheat)\b"),
    ("How many continents are there?", r"\b(7|seven)\b"),
    ("What do plants need from the sun to grow?", r"\b(light|sunlight|energy)\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("Which fruit is used to make wine?", r"\bgrapes?\b"),
    ("What is the boiling point of water in Celsius?", r"\b(100|one hundred)\b"),
    ("What instrument has black and white keys?", r"\bpianos?\b"),
    ("What is the color of snow?", r"\bwhite\b"),
    ("Which animal says moo?", r"\bcows?\b"),
    ("What day comes after Monday?", r"\btuesday\b"),
]
"""(question, accepted-answer pattern[, rejected pattern]): 36 everyday questions. An answer that
also names a rejected alternative ("the largest planet is Jupiter, but ... Earth") is wrong."""

HELD_OUT: list[tuple[str, ...]] = [
    ("What is the capital of England?", r"\blondon\b"),
    ("What is the capital of Russia?", r"\bmoscow\b"),
    ("How many wheels does a car have?", r"\b(4|four) wheels\b"),
    ("How many months are in a year?", r"\b(12|twelve)\b"),
    ("How many seconds are in a minute?", r"\b(60|sixty)\b"),
    ("What color is a ripe tomato?", r"\bred\b"),
    ("What color is coal?", r"\bblack\b"),
    ("What animal gives us wool?", r"\bsheep\b"),
    ("Which bird is a symbol of peace?", r"\bdoves?\b"),
    ("What do you call a baby dog?", r"\bpupp(y|ies)\b"),
    ("What is the opposite of up?", r"\bdown\b"),
    ("What is the opposite of day?", r"\bnight\b"),
    ("What language is spoken in France?", r"\bfrench\b"),
    ("Who painted the Mona Lisa?", r"\b(leonardo|da vinci)\b"),
    ("What is the largest desert in Africa?", r"\bsahara\b"),
    ("Which organ pumps blood through the body?", r"\bheart\b"),
    ("What do we use to see?", r"\beyes?\b"),
    ("What is the first month of the year?", r"\bjanuary\b"),
    ("What season comes after summer?", r"\b(autumn|fall)\b"),
    ("Which planet is known as the red planet?", r"\bmars\b"),
    ("What is the capital of Spain?", r"\bmadrid\b"),
    ("What do caterpillars turn into?", r"\bbutterfl(y|ies)\b"),
    ("What is the hottest planet in our solar system?", r"\bvenus\b"),
    ("What metal is a wedding ring often made of?", r"\b(gold|silver|platinum)\b"),
]
"""A second set, never used while designing the prompt: how well the design generalises."""

SETS = {"main": QUESTIONS, "held_out": HELD_OUT, "all": QUESTIONS + HELD_OUT}


def correct(answer: str, pattern: str, reject: str | None = None) -> bool:
    """Whether `answer` matches the accepted-answer `pattern` and not the `reject` one."""
    if reject and re.search(reject, answer, re.IGNORECASE):
        return False
    return re.search(pattern, answer, re.IGNORECASE) is not None


async def ask_server(url: str, token: str, timeout_s: float, questions: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    """Every question as a text turn in one Realtime session; answers as the client saw them."""
    from tristream.serve.client import RealtimeClient

    cli = await RealtimeClient.connect(url, token)
    rows: list[dict[str, Any]] = []
    try:
        await cli.send({"type": "session.update", "session": {"modalities": ["text"]}})
        for q, pattern, *reject in questions:
            t0 = time.perf_counter()
            await cli.send({"type": "conversation.item.create",
                            "item": {"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": q}]}})
            await cli.send({"type": "response.create"})
            answer, first, audio_deltas, status = "", None, 0, ""
            while True:
                ev = await cli.recv(timeout=timeout_s)
                kind = ev.get("type", "")
                if kind in ("response.text.delta", "response.audio_transcript.delta") and first is None:
                    first = time.perf_counter() - t0
                if kind == "response.audio.delta":
                    audio_deltas += 1
                if kind == "response.text.done":
                    answer = ev.get("text", "")
                if kind == "response.audio_transcript.done":
                    answer = ev.get("transcript", "")
                if kind == "error":
                    print("server error:", ev.get("error"), file=sys.stderr)
                if kind == "response.done":
                    status = ev["response"]["status"]
                    break
            rows.append({"question": q, "answer": answer, "accepted": pattern, "correct": correct(answer, pattern, *reject),
                         "status": status, "first_text_s": first, "answer_s": time.perf_counter() - t0,
                         "audio_deltas": audio_deltas})
            print(f"{'ok ' if rows[-1]['correct'] else 'NO '} {q} -> {answer!r}", flush=True)
    finally:
        await cli.close()
    return rows


def run_server(serve_args: list[str], timeout_s: float, questions: list[tuple[str, ...]]
               ) -> tuple[list[dict[str, Any]], float]:
    """Start the real server, ask, stop it; returns the rows and the server's start-up seconds."""
    port, token = free_port(), "bench-token"
    cmd = [sys.executable, "-m", "tristream.cli", "serve", "--token", token, "--port", str(port), *serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        try:
            wait_healthy(proc, port)
        except ServerDidNotStart as exc:
            raise SystemExit(str(exc)) from None
        startup = time.perf_counter() - t0
        rows = asyncio.run(ask_server(f"ws://127.0.0.1:{port}/v1/realtime", token, timeout_s, questions))
        return rows, startup
    finally:
        stop_process(proc, timeout_s=30)


def run_direct(quant: str, history: int, questions: list[tuple[str, ...]], system: str | None = None
               ) -> list[dict[str, Any]]:
    """The session's LLM path (`EngineChatBackend` with the prompt module) in-process, one
    conversation, no server: quick prompt iteration."""
    from tristream.pipeline.llm import EngineChatBackend
    from tristream.pipeline.prompt import DECODE, Conversation

    chat = EngineChatBackend.load(None, "cpu", quant)
    conv = Conversation(max_turns=history) if system is None else Conversation(system, max_turns=history)

    async def go() -> list[dict[str, Any]]:
        rows = []
        for q, pattern, *reject in questions:
            t0 = time.perf_counter()
            msgs = conv.prompt(q)
            conv.add_user(q)
            cut, answer = DECODE.cut(), ""
            async for d in chat.stream(msgs, DECODE.max_tokens):  # what the session's LLM stage does
                answer += cut.push(d)
                if cut.done:
                    break
            answer = answer.strip()
            conv.add_assistant(answer)
            rows.append({"question": q, "answer": answer, "accepted": pattern, "correct": correct(answer, pattern, *reject),
                         "answer_s": time.perf_counter() - t0})
            print(f"{'ok ' if rows[-1]['correct'] else 'NO '} {q} -> {answer!r}", flush=True)
        return rows

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--direct", action="store_true", help="in-process engine instead of the server")
    ap.add_argument("--quant", default="auto", help="--direct: engine weights (auto, none, int8, int4)")
    ap.add_argument("--history", type=int, default=3, help="--direct: exchanges of history in the prompt")
    ap.add_argument("--set", choices=sorted(SETS), default="main", help="which questions")
    ap.add_argument("--system-file", type=Path, help="--direct: a system prompt to try instead of the module's")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `tristream serve` argument")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one event")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "assistant.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    startup = None
    if a.direct:
        rows = run_direct(a.quant, a.history, SETS[a.set], a.system_file.read_text().strip() if a.system_file else None)
    else:
        rows, startup = run_server(a.serve_arg, a.timeout, SETS[a.set])
    n_ok = sum(r["correct"] for r in rows)
    out = {
        "what": "everyday questions in one conversation, text turns, accepted-answer patterns",
        "mode": "direct (in-process engine)" if a.direct else "server (tristream serve, Realtime over WebSocket)",
        "serve_args": a.serve_arg, "quant": a.quant if a.direct else None,
        "history": a.history if a.direct else None, "system_file": str(a.system_file) if a.system_file else None,
        "set": a.set, "questions": len(rows), "correct": n_ok, "accuracy": n_ok / max(1, len(rows)),
        "audio_deltas_total": sum(r.get("audio_deltas", 0) for r in rows),
        "server_startup_s": startup, "wall_s": time.perf_counter() - t0,
        "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "commit": git_commit(), "cpu": cpu_info(), "rows": rows,
    }
    print(f"\n{n_ok}/{len(rows)} correct ({100 * n_ok / max(1, len(rows)):.0f}%), wall {out['wall_s']:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
