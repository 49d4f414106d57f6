"""The browser page end to end in headless Chromium with fake mic and camera fed from files.

Needs Debian's ``chromium`` (``apt-get install chromium``) and the ``playwright`` Python
package; skipped when either is missing. Chromium plays ``speech.wav`` as the microphone
and ``camera.y4m`` as the camera; the page streams both to the real server on loopback.
"""

from __future__ import annotations

import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, running_server, tone_turns

CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", "/usr/bin/chromium") if Path(p).exists()), None) \
    or shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (apt-get install chromium)")


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())


def write_y4m(path: Path, frames: int = 20, w: int = 160, h: int = 120) -> None:
    """A moving gradient as YUV 4:2:0 (the format Chromium's fake camera reads)."""
    with path.open("wb") as f:
        f.write(f"YUV4MPEG2 W{w} H{h} F10:1 Ip A1:1 C420jpeg\n".encode())
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(frames):
            f.write(b"FRAME\n")
            f.write(((xx + yy + 8 * i) % 256).astype(np.uint8).tobytes())
            f.write(np.full((h // 2) * (w // 2) * 2, 128, np.uint8).tobytes())


def test_browser_page_end_to_end(tmp_path: Path) -> None:
    pw = pytest.importorskip("playwright.async_api")
    wav, y4m = tmp_path / "speech.wav", tmp_path / "camera.y4m"
    # One 600 ms voiced turn, then silence long enough for the VAD and the answer.
    write_wav(wav, tone_turns([600], rate=48_000, gap_ms=4000), 48_000)
    write_y4m(y4m)

    async def go() -> None:
        async with running_server() as srv, pw.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}%noloop", f"--use-file-for-fake-video-capture={y4m}",
                "--autoplay-policy=no-user-gesture-required", "--no-sandbox"])
            try:
                page = await browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                await page.goto(f"http://127.0.0.1:{srv.port}/#token={TOKEN}")
                await page.click("#start")
                await page.wait_for_function("window.tristream.latencies.length >= 1", timeout=20_000)
                state = await page.evaluate("window.tristream")
                await page.screenshot(path=str(tmp_path / "page.png"))
            finally:
                await browser.close()
        assert not errors, errors
        assert state["connected"] and not state["errors"]
        assert state["transcripts"][0].startswith("speech ")
        voiced_ms = int(state["transcripts"][0].split()[1])
        # a 600 ms tone; Chromium's fake capture drops buffers when the CPU is starved (320 ms seen
        # on a loaded 2-core CI runner), so this only checks that the tone, and not silence, was heard
        assert 150 <= voiced_ms <= 1000
        assert state["answers"][0].startswith(f"echo: speech {voiced_ms} ms")
        assert state["framesSent"] >= 1 and "frames" in state["answers"][0]
        assert state["audioSamplesPlayed"] > 0
        lat = state["latencies"][0]
        assert lat["status"] == "completed" and lat["audio_ms"] is not None and lat["audio_ms"] > 0
    run(go(), timeout=60)
