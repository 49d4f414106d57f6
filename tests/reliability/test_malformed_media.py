"""Issue 9 item 5 (fast form): malformed media gets a coded `error`, kills nothing, touches no one else.

One abusive session sends every kind of broken media over a live echo server while three
well-behaved sessions run turns; then the embedded pipeline's decoder gets a corrupt JPEG.
(The < 10% P99 criterion for the other sessions is measured in `bench/reliability.py`.)
"""

from __future__ import annotations

import asyncio
import base64
import json

from tests.reliability.live import connect_auth, text_turn
from tests.serve.helpers import TOKEN, run, running_server, url
from tristream.serve.limits import ServerLimits

B64 = base64.b64encode


def _b(data: bytes) -> str:
    return B64(data).decode()


def sof_jpeg(w: int, h: int, body: bytes = b"") -> bytes:
    """A structurally whole JPEG declaring w x h (SOI, SOF0, body, EOI)."""
    return (b"\xff\xd8\xff\xc0\x00\x0b\x08" + h.to_bytes(2, "big") + w.to_bytes(2, "big")
            + b"\x01\x01\x11\x00" + body + b"\xff\xd9")


def audio(data: bytes, **kw: object) -> dict:
    return {"type": "input_audio_buffer.append", "audio": _b(data), **kw}


def frame(data: bytes, fmt: str = "jpeg", ts: int = 1, **kw: object) -> dict:
    return {"type": "tristream.input_video_frame.append", "frame": _b(data), "format": fmt,
            "capture_ts_us": ts, **kw}


# (raw message, expected error code): each one must be answered with exactly this code
CASES: list[tuple[str, str]] = [
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
    (json.dumps(audio(b"")), "invalid_value"),                                 # zero-length audio
    (json.dumps(audio(b"\x01\x02\x03")), "invalid_value"),                     # odd-length audio
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 44100}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 16000.5}}), "invalid_value"),
    ('{"type": "session.update", "session": {"temperature": NaN}}', "invalid_json"),           # NaN
    ('{"type": "session.update", "session": {"temperature": Infinity}}', "invalid_json"),      # inf
    ('{"type": "input_audio_buffer.append", "audio": "AAA=", "capture_ts_us": 1e999}', "invalid_value"),
    (json.dumps(audio(b"\x00\x00", capture_ts_us=2**70)), "invalid_value"),    # timestamp overflow
    (json.dumps(audio(b"\x00\x00" * 10, capture_ts_us=5_000)), ""),            # fine (sets the clock)
    (json.dumps(audio(b"\x00\x00" * 10, capture_ts_us=4_000)), "invalid_value"),  # audio time backwards
    (json.dumps(frame(sof_jpeg(64, 48), ts=9_000)), ""),                       # fine
    (json.dumps(frame(sof_jpeg(64, 48), ts=8_000)), "invalid_value"),          # video time backwards
    (json.dumps(frame(sof_jpeg(64, 48)[:-6], ts=10_000)), "invalid_value"),    # truncated JPEG
    (json.dumps(frame(sof_jpeg(60_000, 60_000), ts=10_000)), "invalid_value"),  # decompression bomb
    (json.dumps(frame(sof_jpeg(0, 48), ts=10_000)), "invalid_value"),          # empty image
    (json.dumps(frame(b"\x89PNG\r\n\x1a\n" + bytes(40), ts=10_000)), "invalid_value"),  # PNG as jpeg
    (json.dumps(frame(sof_jpeg(64, 48), ts=10_000, width=32, height=48)), "invalid_value"),  # size mismatch
    (json.dumps(frame(bytes(100), fmt="rgb24", width=10, height=10, ts=10_000)), "invalid_value"),  # bytes
    (json.dumps(frame(bytes(100), fmt="pcm16", ts=10_000)), "invalid_value"),  # modality mismatch
    (json.dumps(frame(bytes(100), fmt="gray8", ts=-1, width=10, height=10)), "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "system", "content": [
        {"type": "input_image", "image_url": "data:image/jpeg;base64," + _b(sof_jpeg(8, 8))}]}}), "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": "AAAA"}]}}), "invalid_value"),
    (json.dumps({"type": "response.create", "response": {"modalities": ["video"]}}), "invalid_value"),
    (json.dumps(frame(sof_jpeg(64, 48, bytes(70_000)), ts=10_000)), "message_too_large"),  # huge JPEG
    (b"\xff\xd8\xff\xe0 binary frame".decode("latin-1").encode("latin-1").hex(), "invalid_json"),
]


def test_every_malformed_input_gets_its_code_and_nobody_else_notices() -> None:
    async def go() -> None:
        async with running_server(limits=ServerLimits(max_message_bytes=64 * 1024)) as srv:
            good = [await connect_auth(url(srv), TOKEN) for _ in range(3)]
            ref = [await text_turn(ws, f"before {i}") for i, ws in enumerate(good)]
            bad = await connect_auth(url(srv), TOKEN, max_size=None)

            async def abuse() -> list[tuple[str, str]]:
                got = []
                for k, (raw, want) in enumerate(CASES):
                    ev = json.loads(raw) if raw.startswith("{") and "NaN" not in raw and "Infinity" not in raw \
                        and "1e999" not in raw else None
                    if isinstance(ev, dict):
                        ev["event_id"] = f"case{k}"
                        raw = json.dumps(ev)
                    await bad.send(raw)
                    if not want:
                        continue
                    reply = json.loads(await asyncio.wait_for(bad.recv(), 5))
                    assert reply["type"] == "error", (k, reply)
                    got.append((reply["error"]["code"], want))
                    if isinstance(ev, dict) and want != "message_too_large":  # too large: never parsed
                        assert reply["error"]["event_id"] == f"case{k}"
                await bad.send(b"\x00\x01binary")
                reply = json.loads(await asyncio.wait_for(bad.recv(), 5))
                got.append((reply["error"]["code"], "invalid_event"))
                return got

            during = asyncio.gather(*(text_turn(ws, f"before {i}") for i, ws in enumerate(good)))
            got = await abuse()
            others = await during
            for code, want in got:
                assert code == want
            assert others == ref  # the well-behaved sessions saw exactly what they saw before
            after = await text_turn(bad, "still alive")  # the abuser's session survived every case
            assert after[-1][0] == "response.done" and '"completed"' in after[-1][1]
            assert srv.metrics.count("tristream_sessions_closed_total", reason="server_error") == 0
            for ws in [*good, bad]:
                await ws.close()
    run(go(), timeout=60)


def test_pipeline_decoder_refuses_a_corrupt_jpeg_with_a_code(pipeline_models: object) -> None:
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.server import RealtimeServer

    models, _ = pipeline_models  # type: ignore[misc]

    async def go() -> None:
        srv = RealtimeServer(lambda: PipelineBackend(models), port=0, tokens=[TOKEN])
        await srv.start()
        try:
            ws = await connect_auth(url(srv), TOKEN)
            corrupt = sof_jpeg(64, 48, b"\xff\xda\x00\x08" + bytes(200))  # whole, declared sane, garbage scan
            await ws.send(json.dumps(frame(corrupt, ts=1, event_id="j1")))
            ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert ev["type"] == "error" and ev["error"]["code"] == "invalid_value", ev
            assert "decoded" in ev["error"]["message"]
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))  # session goes on
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "input_audio_buffer.cleared"
            await ws.close()
        finally:
            await srv.stop(grace_s=0.0)
    run(go(), timeout=60)
