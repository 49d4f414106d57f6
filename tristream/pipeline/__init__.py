"""Sessions: asyncio stages wired by bounded two-lane inboxes, turn-taking and barge-in.

- `stage.Stage`, `pipeline.Pipeline`, `inbox.Inbox`: the stage runtime.
- `session.Session` over `models.load_models()`: VAD → ASR → turns → LLM → TTS → playout.
- `llm.EngineChatBackend` / `llm.OpenAIChatBackend` (`--llm-url`).
- `demo.run_demo(...)`: `tristream demo`.
"""

import logging
import os

from tristream.core.openmp import ENV, prefer_passive_waits

# before torch loads: the session's stages share a few cores (core/openmp.py)
if not prefer_passive_waits() and ENV not in os.environ:
    logging.getLogger(__name__).warning(
        "torch was imported before tristream.pipeline, so its OpenMP threads spin while they wait "
        "(decode several times slower beside the speech stages on a few cores): import "
        "tristream.pipeline first, or set %s=PASSIVE before torch loads", ENV)
