"""Sessions: asyncio stages wired by bounded two-lane inboxes, turn-taking and barge-in.

- `stage.Stage`, `pipeline.Pipeline`, `inbox.Inbox`: the stage runtime.
- `session.Session` over `models.load_models()`: VAD → ASR → turns → LLM → TTS → playout.
- `llm.EngineChatBackend` / `llm.OpenAIChatBackend` (`--llm-url`).
- `demo.run_demo(...)`: `tristream demo`.
"""

from tristream.core.openmp import prefer_passive_waits

prefer_passive_waits()  # before torch loads: the session's stages share a few cores (core/openmp.py)

