"""Interop: Pipecat's OpenAI Realtime service holds a spoken conversation with a tool call against `tristream serve`.

    /work/bench-venv-pipecat/bin/python bench/interop.py [--port 8790] [--main-python .venv/bin/python]

Runs in a separate bench environment (``python -m venv /work/bench-venv-pipecat &&
/work/bench-venv-pipecat/bin/pip install "pipecat-ai[openai]==1.14.0"``), never in the main
install. It synthesises the user's turns with piper in the main environment (``synth``
sub-command, run through ``--main-python``), starts ``tristream serve`` (the default assistant
backend: Silero VAD, streaming Whisper base, SmolLM2-135M on our engine, piper) on loopback,
and drives a Pipecat pipeline (user context aggregator -> `OpenAIRealtimeLLMService` pointed at
``ws://127.0.0.1:PORT/v1/realtime`` -> assistant context aggregator, the GA protocol Pipecat
speaks) whose microphone is the synthesised speech pushed as ``InputAudioRawFrame`` in real time
(20 ms frames at 16 kHz, silence between turns; the server's VAD ends the turns).

The conversation: Pipecat's initial response (a greeting), a spoken weather question with a
``get_weather`` tool registered through Pipecat (``register_function``), then a spoken turn
without a tool. The embedded SmolLM2-135M does not choose a function by itself (``auto``:
0/40 in bench/tools.py), so the bench sets ``tool_choice`` to ``required`` through Pipecat's
``LLMUpdateSettingsFrame`` before the weather turn and back to ``auto`` in the function
handler, before its result goes back: the server then decodes the call under the schema, Pipecat
runs the handler, sends the ``function_call_output`` and asks for the answer that uses it.
``livekit`` (run it with ``/work/bench-venv-livekit/bin/python``, livekit-agents and
livekit-plugins-openai installed there) holds the same conversation through LiveKit's plugin
(`RealtimeModel` / `RealtimeSession` driven directly, no LiveKit server). ``pipecat-chat`` is
Pipecat's cascaded LLM service (`OpenAILLMService`) on ``/v1/chat/completions`` of the side
port: the weather question as text with the tool (``tool_choice`` required, then auto), its
answer, and a follow-up. Everything seen is written to bench/results/interop.json (one key per
client): per turn the user transcript, the
function call and its arguments, the answer text, seconds of answer audio and end of speech ->
first answer audio as Pipecat saw it, plus every error frame, Pipecat's
``conversation.item.truncate`` requests (it sends one at each user speech start: the bench has no
output transport to say the bot stopped speaking) and LiveKit's ``generate_reply()`` futures
(resolved when the server echoes ``response.metadata``; the answer after a tool output is consumed
through it, as LiveKit's ``AgentSession`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "interop-token"
TURNS = [("weather", "What is the weather like in Paris today?"), ("thanks", "Thank you. What should I wear then?")]
WEATHER = {"city": "Paris", "condition": "light rain", "temperature_c": 12}


def synth(out: Path) -> None:
    """Main environment: the user's turns as 16 kHz wavs (piper, deterministic)."""
    sys.path.insert(0, str(ROOT))
    from tristream.stages.audio_io import write_wav
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    out.mkdir(parents=True, exist_ok=True)
    tts = PiperTTS(deterministic=True)
    for name, text in TURNS:
        clip = resample(tts.synthesize(text), tts.sample_rate, 16_000)
        a, b = energy_edges(clip, 16_000)
        write_wav(out / f"{name}.wav", clip[a:b], 16_000)


def read_wav(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16_000 and w.getnchannels() == 1
        return w.readframes(w.getnframes())


def start_server(python: str, port: int, log: Path, chat_port: int = -1) -> subprocess.Popen[bytes]:
    """``tristream serve`` with its log in a file (a pipe nobody reads fills up and stalls the server)."""
    from bench._common import ServerDidNotStart, wait_healthy

    env = {k: v for k, v in os.environ.items() if k != "TRISTREAM_TOKEN"}
    with log.open("wb") as f:
        proc = subprocess.Popen([python, "-m", "tristream.cli", "serve", "--token", TOKEN, "--port", str(port),
                                 "--chat-port", str(chat_port)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, output=log.read_text)
    except ServerDidNotStart as exc:
        raise SystemExit(str(exc)) from None
    return proc


async def until_len(items: list[Any], n: int, timeout: float) -> None:
    """Until `items` (filled by the framework's callbacks) holds `n` entries, or `timeout` s pass."""
    end = time.monotonic() + timeout
    while len(items) < n and time.monotonic() < end:
        await asyncio.sleep(0.05)


def server_info(port: int) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


async def pipecat_conversation(port: int, clips: dict[str, bytes]) -> dict[str, Any]:
    from pipecat.adapters.schemas.function_schema import FunctionSchema
    from pipecat.adapters.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        FunctionCallInProgressFrame,
        FunctionCallResultFrame,
        InputAudioRawFrame,
        LLMFullResponseEndFrame,
        LLMRunFrame,
        LLMTextFrame,
        LLMUpdateSettingsFrame,
        TranscriptionFrame,
        TTSAudioRawFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.llm_service import FunctionCallParams
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    t0 = time.monotonic()
    log: list[dict[str, Any]] = []  # what Pipecat's frames said, in order
    state: dict[str, Any] = {"eos": None, "responses": 0, "first_audio": None}
    responses: list[dict[str, Any]] = []
    cur: dict[str, Any] = {"text": "", "audio_s": 0.0, "first_audio_s": None}

    class Tap(FrameProcessor):  # records the frames that pass, both ways, and passes them on
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            now = round(time.monotonic() - t0, 3)
            if isinstance(frame, TranscriptionFrame):
                log.append({"t": now, "frame": "transcription", "text": frame.text})
            elif isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
                if cur["first_audio_s"] is None:
                    cur["first_audio_s"] = now
                cur["audio_s"] += len(frame.audio) / 2 / frame.sample_rate
            elif isinstance(frame, LLMTextFrame) and direction == FrameDirection.DOWNSTREAM:
                cur["text"] += frame.text
            elif isinstance(frame, FunctionCallInProgressFrame) and direction == FrameDirection.DOWNSTREAM:
                log.append({"t": now, "frame": "function_call", "name": frame.function_name,
                            "arguments": frame.arguments})
            elif isinstance(frame, FunctionCallResultFrame) and direction == FrameDirection.DOWNSTREAM:
                log.append({"t": now, "frame": "function_result", "name": frame.function_name, "result": frame.result})
            elif isinstance(frame, LLMFullResponseEndFrame):
                responses.append({"t": now, "text": cur["text"].strip(), "audio_s": round(cur["audio_s"], 2),
                                  "first_audio_t": cur["first_audio_s"]})
                log.append({"t": now, "frame": "response_end", "text": cur["text"].strip()})
                cur.update(text="", audio_s=0.0, first_audio_s=None)
            elif isinstance(frame, ErrorFrame):
                log.append({"t": now, "frame": "error", "error": str(frame.error)})
            await self.push_frame(frame, direction)

    weather = FunctionSchema(name="get_weather", description="Get the current weather in a city",
                             properties={"city": {"type": "string", "description": "the city"}}, required=["city"])
    tools = ToolsSchema(standard_tools=[weather])

    def props(choice: str) -> Any:
        return events.SessionProperties(
            instructions="You are a helpful voice assistant. Answer in one or two short sentences.",
            tool_choice=choice,  # type: ignore[arg-type]
            audio=events.AudioConfiguration(input=events.AudioInput(
                transcription=events.InputAudioTranscription(),
                turn_detection=events.TurnDetection(silence_duration_ms=600))))

    llm = OpenAIRealtimeLLMService(api_key=TOKEN, base_url=f"ws://127.0.0.1:{port}/v1/realtime",
                                   settings=OpenAIRealtimeLLMService.Settings(session_properties=props("auto")))
    calls: list[dict[str, Any]] = []

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append({"t": round(time.monotonic() - t0, 3), "arguments": params.arguments})
        # back to auto before the result goes in: the answer that follows is in words
        await llm._update_settings(OpenAIRealtimeLLMService.Settings(session_properties=props("auto")))
        await params.result_callback({**WEATHER, "city": params.arguments.get("city", "Paris")})

    llm.register_function("get_weather", get_weather)
    send_event = llm.send_client_event

    async def send_seen(event: Any) -> None:  # the truncations Pipecat asks for, as it sends them
        if isinstance(event, events.ConversationItemTruncateEvent):
            log.append({"t": round(time.monotonic() - t0, 3), "frame": "truncate", "item_id": event.item_id,
                        "audio_end_ms": event.audio_end_ms})
        await send_event(event)

    llm.send_client_event = send_seen  # type: ignore[method-assign]
    context = LLMContext([{"role": "user", "content": "Say hello in one short sentence."}], tools=tools)
    pair = LLMContextAggregatorPair(context)
    speaker = Tap()
    pipeline = Pipeline([pair.user(), Tap(), llm, speaker, pair.assistant()])

    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=16_000, audio_out_sample_rate=24_000),
                            enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    run_task = asyncio.create_task(runner.run(worker))

    mic_queue: list[bytes] = []
    ends: dict[str, float] = {}

    async def mic() -> None:  # 20 ms frames in real time: the queued clip, else silence
        frame_bytes, nxt = 640, time.monotonic()
        buf = b""
        while True:
            if not buf and mic_queue:
                buf = mic_queue.pop(0)
            chunk, buf = (buf[:frame_bytes], buf[frame_bytes:]) if buf else (b"\0" * frame_bytes, b"")
            chunk = chunk.ljust(frame_bytes, b"\0")
            await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=16_000, num_channels=1))
            if not buf and "pending_end" in state:
                ends[state.pop("pending_end")] = round(time.monotonic() - t0, 3)
            nxt += 0.02
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    turns: list[dict[str, Any]] = []

    async def dump_tasks() -> None:  # INTEROP_DEBUG=1: the stacks of all tasks every 15 s
        while True:
            await asyncio.sleep(15)
            for task in asyncio.all_tasks():
                frames = task.get_stack(limit=8)
                print("TASK", task.get_name(), [f"{f.f_code.co_filename.split('/')[-1]}:{f.f_lineno}:{f.f_code.co_name}"
                                               for f in frames], file=sys.stderr)

    if os.environ.get("INTEROP_DEBUG"):
        asyncio.create_task(dump_tasks())
    try:
        await asyncio.sleep(1.0)
        await worker.queue_frame(LLMRunFrame())  # the greeting
        await until_len(responses, 1, 120)
        mic_task = asyncio.create_task(mic())
        await asyncio.sleep(1.0)
        for i, (name, text) in enumerate(TURNS):
            before = len(responses)
            if name == "weather":  # the small model does not pick a function by itself: require one for this turn
                await worker.queue_frame(LLMUpdateSettingsFrame(
                    delta=OpenAIRealtimeLLMService.Settings(session_properties=props("required"))))
                await asyncio.sleep(0.3)
            mic_queue.append(clips[name])
            state["pending_end"] = name
            # the weather turn: a call-only response, then the answer with the tool output
            await until_len(responses, before + (2 if name == "weather" else 1), 180)
            await asyncio.sleep(1.0)
            turns.append({"turn": i + 1, "said": text, "speech_end_t": ends.get(name),
                          "responses": responses[before:]})
        mic_task.cancel()
    finally:
        await worker.cancel()
        await asyncio.wait_for(run_task, 30)
    for t in turns:
        end = t["speech_end_t"]
        firsts = [r["first_audio_t"] for r in t["responses"] if r["first_audio_t"] is not None]
        t["speech_end_to_first_audio_s"] = round(min(firsts) - end, 3) if firsts and end else None
        t["transcripts"] = [e["text"] for e in log if e["frame"] == "transcription" and end and e["t"] >= end - 5
                            and e["t"] <= (t["responses"][-1]["t"] if t["responses"] else 1e9)]
    return {"greeting": responses[0] if responses else None, "turns": turns, "function_calls": calls,
            "truncations": [e for e in log if e["frame"] == "truncate"],
            "errors": [e for e in log if e["frame"] == "error"], "frames": log}


async def livekit_conversation(port: int, clips: dict[str, bytes]) -> dict[str, Any]:
    """LiveKit Agents' OpenAI realtime plugin driven through its RealtimeModel / RealtimeSession API
    directly (no LiveKit server, no room: the session is the plugin's WebSocket client)."""
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins import openai as lk_openai

    t0 = time.monotonic()
    log: list[dict[str, Any]] = []
    responses: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[Any]] = set()
    replies: list[asyncio.Future[Any]] = []  # generate_reply(): resolved when the server's response matches it

    @llm.function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({**WEATHER, "city": city})

    from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

    # the plugin's default turn detection is semantic_vad, which tristream refuses (its VAD ends turns): server_vad
    model = lk_openai.realtime.RealtimeModel(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, model="tristream", tool_choice="auto",
        turn_detection=ServerVad(type="server_vad", silence_duration_ms=600, create_response=True,
                                 interrupt_response=True))
    session = model.session()
    await session.update_instructions("You are a helpful voice assistant. Answer in one or two short sentences.")
    await session.update_tools([get_weather])
    now = lambda: round(time.monotonic() - t0, 3)  # noqa: E731

    async def consume(gen: Any) -> None:
        r: dict[str, Any] = {"text": "", "audio_s": 0.0, "first_audio_t": None, "calls": []}

        async def message(msg: Any) -> None:
            async def text() -> None:
                async for piece in msg.text_stream:
                    r["text"] += str(piece)

            async def audio() -> None:
                async for frame in msg.audio_stream:
                    if r["first_audio_t"] is None:
                        r["first_audio_t"] = now()
                    r["audio_s"] += frame.samples_per_channel / frame.sample_rate

            await asyncio.gather(text(), audio())

        async def messages() -> None:
            async for msg in gen.message_stream:
                await message(msg)

        async def functions() -> None:
            async for fc in gen.function_stream:
                r["calls"].append({"name": fc.name, "arguments": fc.arguments, "call_id": fc.call_id})

        await asyncio.gather(messages(), functions())
        r["t"] = now()
        r["audio_s"] = round(r["audio_s"], 2)
        responses.append(r)
        for c in r["calls"]:  # run the tool, give its output back, ask for the answer (what AgentSession does)
            args = json.loads(c["arguments"])
            calls.append({"t": now(), "arguments": args})
            session.update_options(tool_choice="auto")
            ctx = session.chat_ctx.copy()
            ctx.items.append(llm.FunctionCallOutput(call_id=c["call_id"], name=c["name"],
                                                    output=await get_weather(**args), is_error=False))
            await session.update_chat_ctx(ctx)
            reply = session.generate_reply()  # what AgentSession does: the answer comes through its future
            replies.append(reply)
            try:
                gen = await reply
            except Exception as e:  # noqa: BLE001  (a timeout: recorded, the bench goes on)
                log.append({"t": now(), "frame": "error", "error": f"generate_reply: {e}"})
                continue
            spawn(consume(gen))

    def spawn(coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    def on_generation(ev: Any) -> None:
        if ev.user_initiated:  # generate_reply()'s own: consumed where it was asked (as AgentSession does)
            return
        spawn(consume(ev))

    session.on("generation_created", on_generation)
    session.on("input_audio_transcription_completed",
               lambda ev: log.append({"t": now(), "frame": "transcription", "text": ev.transcript}))
    session.on("error", lambda ev: log.append({"t": now(), "frame": "error", "error": str(getattr(ev, "error", ev))}))

    silence = b"\0" * 640

    async def speak(pcm: bytes, trailing_s: float) -> float:
        nxt, end_t = time.monotonic(), 0.0
        data = pcm + silence * int(trailing_s / 0.02)
        for i in range(0, len(data), 640):
            chunk = data[i:i + 640].ljust(640, b"\0")
            session.push_audio(rtc.AudioFrame(chunk, 16_000, 1, 320))
            if i + 640 >= len(pcm) and not end_t:
                end_t = now()
            nxt += 0.02
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        return end_t

    turns: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(1.0)
        for i, (name, text) in enumerate(TURNS):
            before = len(responses)
            if name == "weather":  # the small model does not pick a function by itself: require one for this turn
                session.update_options(tool_choice="required")
                await asyncio.sleep(0.3)
            feeder = asyncio.create_task(speak(clips[name], 12.0))
            await until_len(responses, before + (2 if name == "weather" else 1), 180)
            end_t = await feeder
            turns.append({"turn": i + 1, "said": text, "speech_end_t": end_t, "responses": responses[before:]})
    finally:
        await session.aclose()
        await model.aclose()
    for t in turns:
        firsts = [r["first_audio_t"] for r in t["responses"] if r["first_audio_t"] is not None]
        t["speech_end_to_first_audio_s"] = round(min(firsts) - t["speech_end_t"], 3) if firsts else None
    # the plugin matches its generate_reply() to the server's response by response.metadata.client_event_id
    futures = [("pending" if not f.done() else f"failed: {f.exception()}" if f.exception() else "resolved")
               for f in replies]
    return {"generate_reply_futures": futures, "turns": turns, "function_calls": calls, "errors": [e for e in log if e["frame"] == "error"],
            "frames": log}


async def pipecat_chat(port: int) -> dict[str, Any]:
    """Pipecat's cascaded LLM service (`OpenAILLMService`) on ``/v1/chat/completions`` of the side port:
    a text conversation with the same tool (streaming, tools in the request)."""
    from pipecat.adapters.schemas.function_schema import FunctionSchema
    from pipecat.adapters.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        FunctionCallInProgressFrame,
        LLMFullResponseEndFrame,
        LLMMessagesAppendFrame,
        LLMRunFrame,
        LLMTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.llm_service import FunctionCallParams
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.workers.runner import WorkerRunner

    t0 = time.monotonic()
    responses: list[dict[str, Any]] = []
    log: list[dict[str, Any]] = []
    cur = {"text": "", "first_t": None}

    class Tap(FrameProcessor):
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            now = round(time.monotonic() - t0, 3)
            if isinstance(frame, LLMTextFrame):
                cur["first_t"] = cur["first_t"] or now
                cur["text"] += frame.text
            elif isinstance(frame, FunctionCallInProgressFrame) and direction == FrameDirection.DOWNSTREAM:
                log.append({"t": now, "frame": "function_call", "name": frame.function_name,
                            "arguments": frame.arguments})
            elif isinstance(frame, LLMFullResponseEndFrame):
                responses.append({"t": now, "text": cur["text"].strip(), "first_text_t": cur["first_t"]})
                cur.update(text="", first_t=None)
            elif isinstance(frame, ErrorFrame):
                log.append({"t": now, "frame": "error", "error": str(frame.error)})
            await self.push_frame(frame, direction)

    weather = FunctionSchema(name="get_weather", description="Get the current weather in a city",
                             properties={"city": {"type": "string", "description": "the city"}}, required=["city"])
    context = LLMContext([{"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
                          {"role": "user", "content": TURNS[0][1]}], tools=ToolsSchema(standard_tools=[weather]),
                         tool_choice="required")  # the small model does not pick a function by itself
    llm = OpenAILLMService(api_key=TOKEN, base_url=f"http://127.0.0.1:{port}/v1",
                           settings=OpenAILLMService.Settings(model="tristream", max_tokens=60))
    calls: list[dict[str, Any]] = []

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append({"t": round(time.monotonic() - t0, 3), "arguments": params.arguments})
        context.set_tool_choice("auto")  # the answer that follows is in words
        await params.result_callback({**WEATHER, "city": params.arguments.get("city", "Paris")})

    llm.register_function("get_weather", get_weather)
    pair = LLMContextAggregatorPair(context)
    worker = PipelineWorker(Pipeline([pair.user(), llm, Tap(), pair.assistant()]), params=PipelineParams(),
                            enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    run_task = asyncio.create_task(runner.run(worker))

    try:
        await asyncio.sleep(0.5)
        await worker.queue_frame(LLMRunFrame())
        await until_len(responses, 2, 120)  # the call, then the answer with its output
        await worker.queue_frame(LLMMessagesAppendFrame(messages=[{"role": "user", "content": TURNS[1][1]}],
                                                        run_llm=True))
        await until_len(responses, 3, 120)
    finally:
        await worker.cancel()
        await asyncio.wait_for(run_task, 30)
    return {"responses": responses, "function_calls": calls, "errors": [e for e in log if e["frame"] == "error"],
            "frames": log, "context": [m if isinstance(m, dict) else str(m) for m in context.get_messages()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="pipecat", choices=["pipecat", "livekit", "pipecat-chat", "synth"])
    ap.add_argument("--out", type=Path, default=Path("/tmp/tristream-interop"))
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--main-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "interop.json")
    args = ap.parse_args()
    if args.cmd == "synth":
        synth(args.out)
        return
    import importlib.metadata as md

    sys.path.insert(0, str(ROOT))
    from bench._common import git_commit, stop_process

    if args.cmd == "pipecat-chat":  # the cascaded LLM service on /v1/chat/completions; no speech
        args.out.mkdir(parents=True, exist_ok=True)
        proc = start_server(args.main_python, args.port, args.out / "server.log", chat_port=args.port + 1)
        try:
            chat = asyncio.run(pipecat_chat(args.port + 1))
        finally:
            stop_process(proc)
        ok = bool(chat["function_calls"]) and len(chat["responses"]) >= 3
        summary = {"function_called": bool(chat["function_calls"]),
                   "function_arguments": chat["function_calls"][0]["arguments"] if chat["function_calls"] else None,
                   "answer_after_tool": chat["responses"][1]["text"] if len(chat["responses"]) > 1 else None,
                   "follow_up_answer": chat["responses"][2]["text"] if len(chat["responses"]) > 2 else None,
                   "held": ok, "errors": len(chat["errors"])}
        record(args.results, "pipecat_chat", {
            "client": {"framework": "pipecat-ai", "version": md.version("pipecat-ai"),
                       "service": "pipecat.services.openai.llm.OpenAILLMService (cascaded: /v1/chat/completions)"},
            "commit": git_commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "summary": summary, **chat})
        print(json.dumps(summary, indent=1))
        return
    subprocess.run([args.main_python, __file__, "synth", "--out", str(args.out)], check=True)
    clips = {name: read_wav(args.out / f"{name}.wav") for name, _ in TURNS}
    proc = start_server(args.main_python, args.port, args.out / "server.log")
    try:
        info = server_info(args.port)
        result = asyncio.run((pipecat_conversation if args.cmd == "pipecat" else livekit_conversation)(args.port, clips))
    finally:
        stop_process(proc)
    weather = next((t for t in result["turns"] if t["said"] == TURNS[0][1]), None)
    ok_call = bool(result["function_calls"]) and result["function_calls"][0]["arguments"].get("city")
    summary = {
        "spoken_turns_answered": sum(1 for t in result["turns"] if any(r["text"] for r in t["responses"])),
        "spoken_turns": len(TURNS),
        "function_called": bool(ok_call),
        "function_arguments": result["function_calls"][0]["arguments"] if result["function_calls"] else None,
        "answer_after_tool": weather["responses"][-1]["text"] if weather and weather["responses"] else None,
        "errors": len(result["errors"]),
    }
    if "truncations" in result:  # Pipecat: conversation.item.truncate at each user speech start
        summary["truncations"] = len(result["truncations"])
    if "generate_reply_futures" in result:  # LiveKit: generate_reply() matched by response.metadata
        summary["generate_reply_futures"] = result["generate_reply_futures"]
    client = ({"framework": "pipecat-ai", "version": md.version("pipecat-ai"),
               "service": "pipecat.services.openai.realtime.llm.OpenAIRealtimeLLMService"}
              if args.cmd == "pipecat" else
              {"framework": "livekit-agents", "version": md.version("livekit-agents"),
               "plugin": f"livekit-plugins-openai {md.version('livekit-plugins-openai')}",
               "service": "livekit.plugins.openai.realtime.RealtimeModel / RealtimeSession (no LiveKit server)"})
    out = {"client": {**client, "python": sys.version.split()[0]},
           "server": {"command": "tristream serve (default assistant backend)", "info": info},
           "commit": git_commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "summary": summary, **result}
    record(args.results, args.cmd, out)
    print(json.dumps(summary, indent=1))


def record(path: Path, key: str, out: dict[str, Any]) -> None:
    """bench/results/interop.json keeps one entry per client (pipecat, livekit, pipecat_chat)."""
    prev = json.loads(path.read_text()) if path.exists() else {}
    prev = {k: v for k, v in prev.items() if k in ("pipecat", "livekit", "pipecat_chat", "bench", "how")}
    prev.update({"bench": "interop", "how": __doc__.strip().splitlines()[0], key: out})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prev, indent=1) + "\n")


if __name__ == "__main__":
    main()
