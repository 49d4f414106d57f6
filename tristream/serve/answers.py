"""What each answer said as it played, so that ``conversation.item.truncate`` can cut the
history to what the user heard (every pipeline backend: CPU, GPU, with or without tools).

`AnswerLog` keeps, per answer, the playout's `HeardText` (its pieces and their samples, at the
sink's rate) and the assistant message the answer left in the session's history. Truncating
answer ``key`` at ``audio_end_ms`` maps the played time back to words and replaces that message
with them (removes it when nothing was heard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_ANSWERS = 64
"""Answers a session can still truncate (older keys are forgotten)."""


@dataclasses.dataclass(slots=True)
class Answer:
    """One answer as played: its pieces (`HeardText`, at `rate`) and the history message it left."""

    heard: Any
    rate: int
    message: dict[str, str] | None = None


class AnswerLog:
    """The answers of one pipeline session, keyed in the order their `ResponseDone` went out."""

    def __init__(self) -> None:
        self.last: int | None = None
        """Key of the answer whose `ResponseDone` went out last; None: none yet."""
        self._answers: dict[int, Answer] = {}
        self._playing: Answer | None = None
        self._n = 0

    def played(self, session: Any, rate: int) -> None:
        """A chunk of the current answer reaches the sink (at `rate`): its pieces are those of the
        session's playout."""
        if session is not None and session.assistant_active:
            heard = session.playout.heard
            if self._playing is None or self._playing.heard is not heard:
                self._playing = Answer(heard, rate)

    def done(self, session: Any) -> None:
        """The current answer ended: it takes the next key, with the message it left in history."""
        conv = session.conversation.messages if session is not None else []
        said = conv[-1] if conv and conv[-1]["role"] == "assistant" else None
        if said is not None and any(said is a.message for a in self._answers.values()):
            said = None  # an answer that added nothing to the history (nothing heard)
        ans = self._playing or Answer(None, 0)
        ans.message, self._playing = said, None
        key, self._n = self._n, self._n + 1
        self._answers[key] = ans
        self._answers.pop(key - MAX_ANSWERS, None)
        self.last = key

    def truncate(self, session: Any, key: int, audio_end_ms: int) -> str | None:
        """The user heard only the first `audio_end_ms` of answer `key`: its history message becomes
        the words of that audio (removed when none); returns them (None: an unknown key)."""
        ans = self._answers.get(key)
        if ans is None:
            return None
        heard = ans.heard.heard(audio_end_ms * ans.rate // 1000) if ans.heard is not None else ""
        msgs = session.conversation.messages if session is not None else []
        at = next((i for i, m in enumerate(msgs) if m is ans.message), None)
        if at is not None and ans.message is not None and len(heard) < len(ans.message["content"]):
            if heard:
                ans.message["content"] = heard
            else:
                del msgs[at]
                ans.message = None
        return heard
