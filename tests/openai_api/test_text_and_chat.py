"""Streaming text pieces (UTF-8 split across tokens, stop strings) and chat templates, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.engine.tokenizer import ByteTokenizer
from hybridkv.openai_api.chat import ChatTemplate
from hybridkv.openai_api.schemas import BadRequest, ChatMessage
from hybridkv.openai_api.text import TextStream

BYTES = ByteTokenizer()


def _pieces(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(BYTES.decode, stop)
    ids = BYTES.encode_continuation(text)
    pieces = [stream.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return pieces, stream


def test_a_character_split_across_tokens_is_held_back_until_complete() -> None:
    pieces, stream = _pieces("né€!")  # é: 2 bytes, €: 3 bytes
    assert pieces == ["n", "", "é", "", "", "€", "!"]
    assert stream.text == "né€!" and not stream.stopped


def test_stop_strings_end_the_text_before_them_even_across_tokens() -> None:
    pieces, stream = _pieces("abc STOP def", stop=("STOP", "xyz"))
    assert "".join(pieces) == "abc " and stream.stopped
    assert all("S" not in p for p in pieces)  # the held-back "S", "ST", "STO" never leaked
    pieces, stream = _pieces("abcxyz", stop=("STOP", "xyz"))
    assert (stream.text, stream.stopped) == ("abc", True)


def test_held_back_text_is_flushed_at_the_end() -> None:
    pieces, stream = _pieces("the end ST", stop=("STOP",))
    assert "".join(pieces) == stream.text == "the end ST" and not stream.stopped
    assert pieces[-1] == "d ST"  # 3 characters (len("STOP") - 1) were held back until the end


def _msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]  # type: ignore[arg-type]


def test_the_tokenizer_config_template_is_rendered_without_special_tokens_added(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    ids = ChatTemplate(tmp_path, BYTES).prompt_ids(_msgs(("system", "be brief"), ("user", "hi")))
    assert ids == [b + 3 for b in b"<s>[system] be brief\n[user] hi\n[assistant] "]


def test_a_chat_template_jinja_file_wins_and_can_refuse(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "unused"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
        "{{ messages[0]['content'] }}|")
    chat = ChatTemplate(tmp_path, BYTES)
    assert chat.prompt_ids(_msgs(("user", "ok"))) == [b + 3 for b in b"ok|"]
    with pytest.raises(BadRequest, match="refused these messages: first message must be the user"):
        chat.prompt_ids(_msgs(("assistant", "no")))


def test_without_a_template_the_plain_one_is_used(tmp_path: Path) -> None:
    ids = ChatTemplate(tmp_path, BYTES).prompt_ids(_msgs(("user", "hi"), ("assistant", "yo"), ("user", "?")))
    assert ids == [2, *(b + 3 for b in b"<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\n?\n<|assistant|>\n")]


def test_turn_ends_are_where_each_earlier_message_ends_in_the_prompt(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    chat = ChatTemplate(tmp_path, BYTES)
    messages = _msgs(("system", "be brief"), ("user", "hi"), ("assistant", "yo"), ("user", "?"))
    ids = chat.prompt_ids(messages)
    # "<s>[system] be brief\n" is 21 bytes, "[user] hi\n" 10 more, "[assistant] yo\n" 15 more
    assert chat.turn_ends(messages, ids) == (21, 31, 46)


def test_cache_checkpoints_in_a_body_are_checked_and_kept_within_the_prompt() -> None:
    from hybridkv.openai_api.schemas import CompletionRequest, to_job

    body = CompletionRequest(prompt=[5] * 40, max_tokens=2, cache_checkpoints=[32, 16, 99])
    assert to_job(body, [5] * 40, max_model_len=128, vocab_size=300).cache_checkpoints == (16, 32)
    with pytest.raises(BadRequest, match="cache_checkpoints must be positive token positions"):
        to_job(CompletionRequest(prompt=[5] * 40, cache_checkpoints=[0]), [5] * 40, max_model_len=128,
               vocab_size=300)
