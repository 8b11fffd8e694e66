"""`POST /tokenize`: vLLM's convention, so a router (and `hybridkv route`) can hash prompts the way
the engine will see them.

    {"model": "m", "prompt": "text", "add_special_tokens": true}     -> {"count", "max_model_len",
    {"model": "m", "messages": [...], "add_generation_prompt": true}     "tokens", "token_strs": null}
"""

from __future__ import annotations

from typing import Any

import msgspec

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.openai_api.chat import ChatTemplate
from hybridkv.openai_api.schemas import BadRequest, ChatMessage


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def tokenize(raw: bytes, *, model_name: str, chat_template: ChatTemplate, tokenizer: Tokenizer,
             max_model_len: int) -> dict[str, Any]:
    """The body of the answer; BadRequest for a body that names no prompt (or another model)."""
    try:
        body = msgspec.json.decode(raw, type=TokenizeRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid /tokenize request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if body.model is not None and body.model != model_name:
        raise BadRequest(f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                         param="model", status=404, kind="not_found_error", code="model_not_found")
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("/tokenize needs exactly one of prompt (a string) or messages (a chat)", param="prompt")
    if body.messages is not None:
        ids = chat_template.prompt_ids(body.messages)
    else:
        assert body.prompt is not None
        ids = (tokenizer.encode if body.add_special_tokens else tokenizer.encode_continuation)(body.prompt)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": None}
