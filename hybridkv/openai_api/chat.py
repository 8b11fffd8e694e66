"""Chat messages -> prompt token ids: the model's own chat template, else a plain documented one.

The model's template is the Jinja template a Hugging Face tokenizer ships: `chat_template.jinja`
in the model directory, else `chat_template` in `tokenizer_config.json` (a string, or a list of
named templates of which "default" is used). It is rendered in a sandbox with `messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token` and `raise_exception`, as transformers
renders it, and the text is tokenized without adding special tokens (the template writes them).

Without one (the embedded default model's byte-level tokenizer, or a model directory that ships
no template) the plain template is used, and its text is tokenized as a prompt (with the
tokenizer's special tokens, e.g. the byte tokenizer's BOS):

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

that is, `<|ROLE|>\\nCONTENT\\n` per message, then `<|assistant|>\\n`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import ConfigError
from hybridkv.openai_api.schemas import BadRequest, ChatMessage


def plain_template(messages: Sequence[tuple[str, str]]) -> str:
    """The plain template's text of (role, content) pairs, ending with the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


class ChatTemplate:
    """Renders chat messages into prompt ids for one model (see the module docstring)."""

    def __init__(self, model_dir: Path, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special: dict[str, str] = {}
        self.source = "plain"
        self._template: Any = None
        text = self._find(model_dir)
        if text is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            try:
                self._template = env.from_string(text)
            except TemplateError as exc:
                raise ConfigError(f"{model_dir}'s chat template does not parse: {exc}") from None

    def _find(self, model_dir: Path) -> str | None:
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        for name in ("bos_token", "eos_token"):
            token = config.get(name)
            self._special[name] = token.get("content", "") if isinstance(token, dict) else (token or "")
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            self.source = str(jinja)
            return jinja.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            self.source = f"{config_path} chat_template"
            return template
        return None

    def turn_ends(self, messages: Sequence[ChatMessage], prompt_ids: Sequence[int]) -> tuple[int, ...]:
        """Where each earlier message ends in `prompt_ids` (the conversation rendered without the
        later messages and the generation prompt, where that is a prefix of the prompt): the positions
        the next turn of this chat resumes from. Templates that render a prefix differently give none."""
        ends: list[int] = []
        for count in range(1, len(messages)):
            pairs = [(m.role, m.text(i)) for i, m in enumerate(messages[:count])]
            if self._template is None:
                ids = self._tokenizer.encode(plain_template(pairs))
            else:
                from jinja2 import TemplateError

                try:
                    text = self._template.render(messages=[{"role": r, "content": c} for r, c in pairs],
                                                 add_generation_prompt=False, **self._special)
                except TemplateError:
                    return tuple(ends)
                ids = self._tokenizer.encode_continuation(text)
            if 0 < len(ids) < len(prompt_ids) and list(prompt_ids[: len(ids)]) == list(ids):
                ends.append(len(ids))
        return tuple(ends)

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt ids of a conversation; BadRequest for no messages or a template's refusal."""
        if not messages:
            raise BadRequest("messages is empty; expected at least one message", param="messages")
        pairs = [(m.role, m.text(i)) for i, m in enumerate(messages)]
        if self._template is None:
            return self._tokenizer.encode(plain_template(pairs))
        from jinja2 import TemplateError

        try:
            text = self._template.render(messages=[{"role": r, "content": c} for r, c in pairs],
                                         add_generation_prompt=True, **self._special)
        except TemplateError as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None
        return self._tokenizer.encode_continuation(text)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)
