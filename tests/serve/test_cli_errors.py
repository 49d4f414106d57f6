"""User mistakes on the command line get one line (`error: ...`), a traceback only with --debug."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tristream.cli import app
from tristream.commands.errors import run

WAV = Path(__file__).resolve().parents[1] / "data" / "speech16k" / "0.wav"


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    rc = run(app, argv)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return rc, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve"], "no token"),
    (["serve", "--token", "T", "--backend", "pipelin"], "did you mean 'pipeline'"),
    (["serve", "--token", "T", "--model", "/nonexistent/model.gguf"], "no such file"),
    (["generate", "--model", "/nonexistent/m.gguf", "hi"], "no such file"),
    (["top", "--once", "--url", "http://127.0.0.1:9/metrics"], "no server answered"),
    (["report", str(WAV)], "is not a tristream recording"),
    (["align", str(WAV), "-o", "/tmp/tristream-align-out.json"], "not a text file"),
])
def test_user_mistakes_print_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    rc, err = one_line(capsys, argv)
    assert rc == 2 and needle in err


def test_cuda_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for argv in (["serve", "--token", "T", "--device", "cuda"], ["generate", "--device", "cuda", "hi"]):
        rc, err = one_line(capsys, argv)
        assert rc == 2 and "no CUDA device" in err


def test_busy_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = one_line(capsys, ["serve", "--token", "T", "--backend", "echo", "--port", str(port)])
    assert rc == 2 and "already in use" in err


def test_debug_shows_the_traceback() -> None:
    from tristream.observe.record import RecordingError

    with pytest.raises(RecordingError):
        run(app, ["--debug", "report", str(WAV)])


def test_the_assistant_picks_its_stages_by_device() -> None:
    from tristream.serve.backends import UnknownBackend, assistant_plan

    kind, kw = assistant_plan({}, cuda=False)  # the CPU stages, the LLM straight on the engine
    assert kind == "pipeline" and kw == {"llm_path": None, "device": "cpu", "quant": "auto"}
    kind, kw = assistant_plan({}, cuda=True)  # GPU stages and the scheduler where CUDA exists
    assert kind == "engine" and kw["stages"] == "gpu" and kw["device"] == "cuda" and kw["model"] == "smollm2"
    kind, kw = assistant_plan({"sched": "ours", "quant": "none"}, cuda=False)
    assert kind == "engine" and kw["stages"] == "embedded" and kw["sched"] == "ours" and kw["quant"] == "none"
    kind, kw = assistant_plan({"device": "cpu", "model": "/m.gguf", "sched": "none"}, cuda=True)
    assert kind == "pipeline" and kw["llm_path"] == "/m.gguf"
    with pytest.raises(UnknownBackend, match="unknown assistant option"):
        assistant_plan({"stages": "gpu"}, cuda=False)
