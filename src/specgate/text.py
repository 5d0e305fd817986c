"""The output text of one request: decoded as it grows, cut at stop strings, streamed once it can no longer change.

Shared by single-request generation (specgate.engine) and the batching scheduler (specgate.serving).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class OutputText:
    """Decodes the output as it grows, finds stop strings, and releases text that can no longer change.

    A stop string may span tokens, so after each step the whole output is decoded and searched from a little
    before the previous end. On a match the output is cut to the shortest token prefix whose text contains the
    stop string; the text ends just before it (OpenAI / vLLM semantics). Streamed text holds back the last
    characters that could still begin a stop string, and a trailing incomplete UTF-8 character.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] | None, on_text: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or [])]
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string: each stop string needs >= 1 character")
        self.hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self.on_text = on_text
        self.text = ""
        self.streamed = 0
        self._searched = 0

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _find_stop(self, text: str, start: int) -> int:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def update(self, tokens: list[int], num_new: int) -> int | None:
        """tokens: the whole output so far, the last num_new just appended. Returns the cut length on a stop hit."""
        text = self.decode(tokens)
        start = max(0, self._searched - self.hold_chars)
        if self.stop and self._find_stop(text, start) >= 0:
            for keep in range(len(tokens) - num_new + 1, len(tokens) + 1):
                prefix_text = self.decode(tokens[:keep])
                hit = self._find_stop(prefix_text, start)
                if hit >= 0:
                    self.text = prefix_text[:hit]
                    self._stream(final=True)
                    return keep
        self.text = text
        self._searched = len(text)
        self._stream(final=False)
        return None

    def _stream(self, final: bool) -> None:
        if self.on_text is None:
            return
        end = len(self.text)
        if not final:
            end -= self.hold_chars
            while end > self.streamed and self.text[end - 1] == "\ufffd":
                end -= 1
        if end > self.streamed:
            self.on_text(self.text[self.streamed : end])
            self.streamed = end

    def finish(self) -> None:
        self._stream(final=True)
