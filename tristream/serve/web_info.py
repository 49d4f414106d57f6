"""What the browser page shows about the server: the backend family, the models that answer, the transports.

``GET /v1/info`` on the realtime port (bearer token, like every API route) answers
`server_info`: the backend (``echo``, ``assistant`` or ``engine``, by the class of the session
backend the server's factory makes), each stage's model by the name the stage gives itself
(VAD, ASR, TTS, vision, end of turn) and the LLM by its architecture, size and device, read
from the loaded weights (the server is never told a model's file name); and where the WebRTC
SDP offer goes (the side HTTP port: the realtime port's WebSocket library reads no request
bodies) or None where aiortc is not installed or the side port is off.

Everything here only reads attributes the backends already have; a backend without them is
described by its class name.
"""

from __future__ import annotations

from typing import Any

FAMILIES = {"EchoBackend": "echo", "PipelineBackend": "assistant", "ToolPipelineBackend": "assistant",
            "EngineSessionBackend": "engine", "EngineTextBackend": "engine"}
ROLES = ("vad", "asr", "tts", "vision", "turn")


def _engine_of(obj: Any) -> Any:
    """The `LLMEngine` behind a chat backend or scheduled engine (None: not our engine)."""
    for path in (("engine",), ("se", "engine"), ("llm", "engine")):
        cur = obj
        for name in path:
            cur = getattr(cur, name, None)
        if cur is not None and getattr(getattr(cur, "model", None), "cfg", None) is not None:
            return cur
    return None


def describe_llm(engine: Any) -> dict[str, Any]:
    """Architecture, parameter count (from the config's shapes, so quantised weights count alike) and device."""
    cfg = engine.model.cfg
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    params = cfg.num_layers * per_layer + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    try:
        device = str(next(engine.model.parameters()).device)
    except (StopIteration, AttributeError, TypeError):
        device = "unknown"
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return {"name": f"{cfg.arch} {size}", "arch": cfg.arch, "parameters": int(params), "layers": cfg.num_layers,
            "device": device, "served_by": "tristream engine"}


def describe_backend(backend: Any) -> dict[str, Any]:
    """The family and models of one session backend (not started; only its attributes are read)."""
    cls = type(backend).__name__
    models: dict[str, Any] = {}
    shared = getattr(backend, "models", None)
    if shared is not None:
        for role in ROLES:
            m = getattr(shared, role, None)
            if m is not None:
                models[role] = str(getattr(m, "name", type(m).__name__))
    engine = _engine_of(backend) or _engine_of(getattr(shared, "llm", None))
    chat = getattr(shared, "llm", None) if shared is not None else None
    if engine is None and chat is None:  # the scheduled engine, captured by the per-session chat maker
        cells = getattr(getattr(backend, "_chat_for_session", None), "__closure__", None) or ()
        engine = next((e for e in (_engine_of(c.cell_contents) for c in cells) if e is not None), None)
    if engine is not None:
        models["llm"] = describe_llm(engine)
    elif chat is not None:
        models["llm"] = {"name": str(getattr(chat, "model", getattr(chat, "name", type(chat).__name__))),
                         "served_by": str(getattr(chat, "name", type(chat).__name__))}
    return {"family": FAMILIES.get(cls, cls), "class": cls, "models": models}


def server_info(server: Any) -> dict[str, Any]:
    """The ``/v1/info`` body for a `RealtimeServer`."""
    backend = next((c.session.backend for c in server.conns.values()), None)
    if backend is None and server.webrtc is not None:
        backend = next((c.session.backend for c in server.webrtc.calls.values()), None)
    if backend is None:
        backend = server.factory()  # only constructed: backends load nothing before start()
    webrtc = None
    if server.webrtc is not None and server.chat is not None:
        webrtc = {"port": server.chat.port, "path": "/v1/realtime/calls"}
    return {"object": "tristream.server_info", "backend": describe_backend(backend),
            "transports": {"websocket": {"path": "/v1/realtime"}, "webrtc": webrtc},
            "chat_completions": server.chat is not None and server.chat.caller is not None}
