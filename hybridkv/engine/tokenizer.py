"""Tokenizers: the model directory's own (`tokenizer.json`, via `tokenizers`), else byte-level.

The byte-level tokenizer serves the embedded default model: ids 0, 1, 2 are pad, eos and bos;
byte b is id b + 3. It round-trips any UTF-8 text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB = 256 + BYTE_OFFSET


class Tokenizer(Protocol):
    """Text <-> token ids."""

    def encode(self, text: str) -> list[int]:
        """Ids of a text that starts a sequence (with the tokenizer's special tokens)."""
        ...

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of a text appended to an existing sequence (no special tokens)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Byte-level: `bos` then one id per UTF-8 byte; decoding skips special ids."""

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *self.encode_continuation(text)]

    def encode_continuation(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` library (special tokens as its post-processor says)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_continuation(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The directory's `tokenizer.json` if present, else the byte-level tokenizer."""
    path = model_dir / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else ByteTokenizer()
