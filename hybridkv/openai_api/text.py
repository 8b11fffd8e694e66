"""Generated token ids -> text pieces for streaming, with OpenAI's stop strings.

    ids so far ──decode──> | emitted | new piece | held back |
                                                 ^ an incomplete UTF-8 character (U+FFFD at the
                                                   end), or the last len(longest stop) - 1
                                                   characters, which may be a stop string's start

Each `add` decodes all ids so far and returns the text not yet emitted, minus what is held back
until more tokens (or the end) decide it. The first stop string found ends the text just before
it (OpenAI leaves the stop string out; `StopText.KEEP`, vLLM's `include_stop_str_in_output`,
ends it just after); the caller then aborts the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

REPLACEMENT = "\ufffd"


class StopText(Enum):
    """Whether the text ends before the stop string that ended it (OpenAI's way) or after it."""

    DROP = "drop"
    KEEP = "keep"


class TextStream:
    """The text of one request's generated tokens, piece by piece."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 stop_text: StopText = StopText.DROP) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._stop_text = stop_text
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found

    def add(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """The new text piece after `token_ids`; `final` flushes what was held back."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self._decode(self.token_ids)
        search_from = max(len(self.text) - self._hold, 0)
        cuts = [(i, len(s)) for i, s in ((full.find(s, search_from), s) for s in self._stop) if i >= 0]
        if cuts:
            self.stopped = True
            start, length = min(cuts)
            end = max(start + (length if self._stop_text is StopText.KEEP else 0), len(self.text))
        elif final:
            end = len(full)
        else:
            end = len(full.rstrip(REPLACEMENT)) - self._hold
        if end <= len(self.text):
            return ""
        piece = full[len(self.text) : end]
        self.text = full[:end]
        return piece
