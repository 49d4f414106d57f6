"""The voice assistant's prompt and decoding settings, shared by `chat`, `generate`, `demo` and `serve`.

Designed for the embedded SmolLM2-135M-Instruct (and harmless for bigger models):

- **Worked examples in the system prompt.** A small model copies the form of the answers it
  sees; a few short question/answer pairs in the system prompt teach it "one plain sentence
  that answers the question" far better than a rule does. They sit in the system message, so
  they are part of the prefix the engine's prefix cache keeps: they cost nothing per turn.
- **The scene only when it is relevant.** A scene line ("a person; bright room") in front of
  "What is the capital of France?" makes the model talk about the picture; it goes with the
  user's message only when the message is about what the camera sees.
- **Bounded history.** The last `history_turns` exchanges; older turns drop out whole (a
  135M model drifts into the style of a long history: after a French question, French).
- **Decoding that stops loops.** Greedy with a repetition penalty, a small token budget and a
  stop at the first blank line (the model's own next "question").

`bench/assistant.py` measures this prompt on everyday questions asked in one conversation
over the Realtime protocol (results in `bench/results/assistant.json`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tristream.engine.sequence import SamplingParams

RULES = ("You are a friendly voice assistant. Answer the user's question directly in one short, "
         "correct sentence of plain spoken English.")

EXAMPLES: tuple[tuple[str, str], ...] = (
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many wheels does a bicycle have?", "A bicycle has two wheels."),
    ("What color is grass?", "Grass is green."),
    ("Which animal barks?", "A dog barks."),
    ("What month comes after March?", "April comes after March."),
)
"""Worked examples: one of each kind of everyday question (a place, a number, a colour, an
animal, an order), none of them in the measuring set of `bench/assistant.py`."""


def system_prompt(rules: str = RULES, examples: tuple[tuple[str, str], ...] = EXAMPLES) -> str:
    """The rules followed by the worked examples as ``User:`` / ``Assistant:`` lines."""
    shots = "\n".join(f"User: {q}\nAssistant: {a}" for q, a in examples)
    return f"{rules}\nExamples:\n{shots}" if examples else rules


SYSTEM_PROMPT = system_prompt()
"""The default system prompt (instructions a client sends replace it)."""

_VISUAL = re.compile(
    r"\b(see|seeing|look|looking|looks|camera|picture|photo|image|show|showing|holding|hold|wearing|"
    r"in front|behind me|around me|this|these|that thing|color of (my|this|the thing)|room|face|"
    r"who am i|how do i look|what am i)\b",
    re.IGNORECASE,
)


def scene_relevant(user_text: str) -> bool:
    """Whether the user's words are about what the camera sees (then the scene goes with them)."""
    return bool(_VISUAL.search(user_text))


@dataclass(slots=True)
class DecodeSettings:
    """Sampling for spoken answers: greedy, a token budget, and an end after the first sentences.

    No repetition penalty by default: the engine applies it to the prompt's tokens too, and over
    a system prompt with examples it pushed SmolLM2 off common words into rambling prose.
    Loops end instead at `max_sentences` sentences (`SentenceCut`) or `max_tokens`.
    """

    max_tokens: int = 48
    temperature: float = 0.0
    repetition_penalty: float = 1.0
    max_sentences: int = 1
    stop: tuple[str, ...] = ("\n\n", "\nUser:", "User:")

    def sampling(self, max_tokens: int | None = None) -> SamplingParams:
        """The engine's `SamplingParams` for one answer."""
        from tristream.engine.sequence import SamplingParams

        return SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                              repetition_penalty=self.repetition_penalty, stop=self.stop)

    def cut(self) -> SentenceCut:
        """A fresh `SentenceCut` for one answer."""
        return SentenceCut(self.max_sentences)


_END = re.compile(r"[.!?](?=\s)")


@dataclass(slots=True)
class SentenceCut:
    """Ends a streamed answer after `max_sentences` sentences (of at least `min_words` words) or
    when a word repeats `max_repeats` times in a row; `push` returns the part of a delta to keep."""

    max_sentences: int = 1
    min_words: int = 3
    max_repeats: int = 4
    text: str = ""
    done: bool = False

    def push(self, delta: str) -> str:
        """Take one text delta; returns what of it belongs to the answer (`done` turns True at the end)."""
        if self.done or self.max_sentences <= 0:
            return "" if self.done else delta
        start = len(self.text)
        self.text += delta
        sentences, last = 0, 0
        for m in _END.finditer(self.text):
            if len(self.text[last:m.end()].split()) >= self.min_words or sentences:
                sentences += 1
                if sentences >= self.max_sentences:
                    self.done = True
                    keep = max(0, m.end() - start)
                    self.text = self.text[:m.end()]
                    return delta[:keep]
            last = m.end()
        words = self.text.split()
        if len(words) >= self.max_repeats and len({w.lower() for w in words[-self.max_repeats:]}) == 1:
            self.done = True
        return delta


DECODE = DecodeSettings()


@dataclass(slots=True)
class Conversation:
    """Chat history for the LLM: system prompt, then alternating user/assistant messages."""

    system: str = SYSTEM_PROMPT
    max_turns: int = 3
    messages: list[dict[str, str]] = field(default_factory=list)
    scene_when: str = "relevant"
    """When the scene goes with the user's message: ``relevant`` (`scene_relevant`), ``always``, ``never``."""

    def prompt(self, user_text: str, scene: str | None = None) -> list[dict[str, str]]:
        """Messages for a new answer: history (last `max_turns` exchanges) plus this turn.

        The scene goes with the new user message (only when the message is about it), not
        into the system prompt, so that the system prompt stays an unchanged prefix.
        """
        hist = self.history()
        use = self.scene_when == "always" or (self.scene_when == "relevant" and scene_relevant(user_text))
        content = f"(The camera sees: {scene})\n{user_text}" if scene and use else user_text
        return [{"role": "system", "content": self.system or SYSTEM_PROMPT}, *hist,
                {"role": "user", "content": content}]

    def history(self) -> list[dict[str, str]]:
        """The last `max_turns` whole exchanges (a user message and the answer after it)."""
        if self.max_turns <= 0:
            return []
        starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        cut = starts[-self.max_turns] if len(starts) >= self.max_turns else 0
        return self.messages[cut:]

    def add_user(self, text: str) -> None:
        """Record the user's turn."""
        self.messages.append({"role": "user", "content": text})
        self._bound()

    def add_assistant(self, text: str) -> None:
        """Record what the user heard of the answer (nothing when they heard nothing)."""
        text = text.strip()
        if text:
            self.messages.append({"role": "assistant", "content": text})
            self._bound()

    def _bound(self) -> None:
        # keep one exchange more than the prompt uses: memory stays bounded on long sessions
        starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if len(starts) > self.max_turns + 1:
            del self.messages[:starts[-(self.max_turns + 1)]]


def clean_answer(text: str) -> str:
    """The answer as spoken: the model's own role labels and trailing fragments removed."""
    t = text.strip()
    if t.lower().startswith("assistant:"):
        t = t[len("assistant:"):].strip()
    return t
