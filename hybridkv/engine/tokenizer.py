"""Tokenizers: the model directory's own (`tokenizer.json`, via `tokenizers`), else byte-level.

The byte-level tokenizer serves the embedded default model: ids 0, 1, 2 are pad, eos and bos
(`<pad>`, `</s>`, `<s>`); byte b is id b + 3. It round-trips any UTF-8 text. The default model's
directory also holds it in Hugging Face's format (`save_byte_tokenizer`: `tokenizer.json` +
`tokenizer_config.json`), so tools that load a tokenizer (`vllm bench serve --tokenizer DIR`,
transformers' AutoTokenizer) count the same ids; its `tokenizer_config.json` marks it
byte-level, and this engine then uses `ByteTokenizer` itself (which, unlike the Hugging Face
one, never reads the text `<s>` in a prompt as the BOS token).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Protocol

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB = 256 + BYTE_OFFSET
SPECIAL_NAMES = ("<pad>", "</s>", "<s>")  # ids 0, 1, 2
BYTE_LEVEL_MARK = "hybridkv_byte_level"  # key in tokenizer_config.json


class SpecialTokens(Enum):
    """Whether decoding drops special tokens (pad, bos, eos, ...) or spells them."""

    SKIP = "skip"
    KEEP = "keep"


class Tokenizer(Protocol):
    """Text <-> token ids."""

    def encode(self, text: str) -> list[int]:
        """Ids of a text that starts a sequence (with the tokenizer's special tokens)."""
        ...

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of a text appended to an existing sequence (no special tokens)."""
        ...

    def decode(self, ids: list[int], special: SpecialTokens = SpecialTokens.SKIP) -> str: ...


class ByteTokenizer:
    """Byte-level: `bos` then one id per UTF-8 byte; decoding skips special ids (or spells them)."""

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *self.encode_continuation(text)]

    def encode_continuation(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], special: SpecialTokens = SpecialTokens.SKIP) -> str:
        if special is SpecialTokens.SKIP or all(i >= BYTE_OFFSET for i in ids):
            data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB)
            return data.decode("utf-8", errors="replace")
        text: list[str] = []
        run = bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_VOCAB:
                run.append(i - BYTE_OFFSET)
            elif i < BYTE_OFFSET:
                text.append(run.decode("utf-8", errors="replace") + SPECIAL_NAMES[i])
                run = bytearray()
        return "".join(text) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` library (special tokens as its post-processor says)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_continuation(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], special: SpecialTokens = SpecialTokens.SKIP) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=special is SpecialTokens.SKIP))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The directory's `tokenizer.json` if present (unless marked byte-level), else the byte-level tokenizer."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ByteTokenizer()
    config = model_dir / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text(encoding="utf-8")).get(BYTE_LEVEL_MARK):
        return ByteTokenizer()
    return HFTokenizer(path)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer writes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def save_byte_tokenizer(model_dir: Path) -> None:
    """Write the byte-level tokenizer as `tokenizer.json` + `tokenizer_config.json` (Hugging Face
    format: a merge-free byte-level BPE, `<s>` prepended, the same ids as `ByteTokenizer`)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tokenizer

    vocab = {name: i for i, name in enumerate(SPECIAL_NAMES)}
    vocab.update({char: b + BYTE_OFFSET for b, char in enumerate(_byte_chars())})
    tok = _Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIAL_NAMES])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False, BYTE_LEVEL_MARK: True}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
