"""Anthropic Messages bodies mapped onto chat messages as vLLM's `/v1/messages` renders them, then tokenized."""

from __future__ import annotations

import json

import pytest

from epp.engine.tinymodel import write_tiny_model
from epp.framework.types import InferenceRequest
from epp.scorers.parsers.anthropic import anthropic_chat_body
from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.pool import TokenizerPool
from tests.support.requests import format_of

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}


def chat_of(**body):
    return anthropic_chat_body({"model": "m", "max_tokens": 8, **body})


def test_the_system_prompt_becomes_the_first_message_its_text_blocks_joined():
    chat = chat_of(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                           {"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
                   messages=[{"role": "user", "content": "hi"}])
    assert chat["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    assert chat_of(system="x-anthropic-billing-header: a\nrest", messages=[{"role": "user", "content": "hi"}])[
        "messages"][0] == {"role": "system", "content": "rest"}
    assert chat_of(messages=[{"role": "user", "content": "hi"}])["messages"] == [{"role": "user", "content": "hi"}]


def test_content_blocks_become_chat_parts():
    chat = chat_of(messages=[{"role": "user", "content": [
        {"type": "image", "source": PNG}, {"type": "image", "source": {"type": "url", "url": "https://x/c.png"}},
        {"type": "text", "text": "compare"}, {"type": "document", "source": PNG}, {"type": "text", "text": ""}]},
        {"role": "user", "content": [{"type": "text", "text": "one text block is a string"}]}])
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                                     {"type": "image_url", "image_url": {"url": "https://x/c.png"}},
                                     {"type": "text", "text": "compare"}]},
        {"role": "user", "content": "one text block is a string"}]


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages():
    chat = chat_of(
        tools=[{"name": "read", "description": "read a file", "input_schema": {"properties": {"path": {}}}}],
        messages=[
            {"role": "user", "content": "open parse.py"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "parse.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "def parse():"}, {"type": "text", "text": "  pass"},
                             {"type": "image", "source": PNG}]},
                {"type": "text", "text": "why is it empty?"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "only a result"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t3", "content": "odd"}]}])
    assert chat["messages"] == [
        {"role": "user", "content": "open parse.py"},
        {"role": "assistant", "content": "Reading.", "reasoning": "I should read it.",
         "reasoning_content": "I should read it.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "read", "arguments": json.dumps({"path": "parse.py"})}}]},
        # A user's tool_result comes before the rest of its message, its images after it as a user message.
        {"role": "tool", "tool_call_id": "t1", "content": "def parse():\n  pass"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}]},
        {"role": "user", "content": "why is it empty?"},
        {"role": "tool", "tool_call_id": "t2", "content": "only a result"},  # no user message left after it
        {"role": "assistant", "content": "Tool result: odd"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "read", "description": "read a file", "parameters": {"properties": {"path": {}}, "type": "object"}}}]


def test_inline_system_messages_stay_in_place_or_merge_into_the_first():
    body = {"system": "A.", "messages": [{"role": "user", "content": "hi"},
                                        {"role": "system", "content": [{"type": "text", "text": "B."}]},
                                        {"role": "user", "content": "again"}]}
    assert [m["role"] for m in chat_of(**body)["messages"]] == ["system", "user", "system", "user"]
    merged = anthropic_chat_body({"model": "m", **body}, merge_inline_system=True)
    assert merged["messages"] == [{"role": "system", "content": "A.B."}, {"role": "user", "content": "hi"},
                                  {"role": "user", "content": "again"}]
    assert chat_of(**body, chat_template_kwargs={"enable_thinking": False})["chat_template_kwargs"] == {
        "enable_thinking": False}


SYSTEM_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")


def test_a_template_that_refuses_a_later_system_message_is_detected():
    assert ChatTemplate(SYSTEM_FIRST).accepts_inline_system is False
    assert ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}").accepts_inline_system is True


def test_tool_call_arguments_reach_the_template_as_objects_as_in_vllm():
    template = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")
    calls = [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"type": "function", "function": {"name": "h", "arguments": "[1]"}},
             {"type": "function", "function": {"name": "i", "arguments": {"b": 2}}}]
    messages = [{"role": "assistant", "content": "", "tool_calls": calls}]
    assert template.render(messages, add_generation_prompt=False) == '{"a": 1};{};{};{"b": 2};'
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # the request itself is left as it was


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = TokenizerPool({"tiny": str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, weights=False))})
    yield pool
    pool.close()


async def test_a_messages_request_is_tokenized_through_the_chat_template(pool):
    body = {"model": "tiny", "max_tokens": 8, "system": "Answer in one word.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "the cache block"}]}]}
    chat = {"model": "tiny", "messages": [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": "the cache block"}]}
    tokens = await pool.tokenize(InferenceRequest("a", "messages", "tiny", "tiny", body, format=format_of("messages")))
    assert tokens
    assert tokens == await pool.tokenize(InferenceRequest("b", "chat/completions", "tiny", "tiny", chat, format=format_of("chat/completions")))


async def test_a_template_that_refuses_inline_system_messages_gets_them_merged(tmp_path):
    model_dir = write_tiny_model(tmp_path / "strict", seed=0, weights=False)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = SYSTEM_FIRST
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    strict = TokenizerPool({"strict": str(model_dir)})
    try:
        body = {"model": "strict", "system": "A.", "messages": [
            {"role": "user", "content": "hi"}, {"role": "system", "content": "B."}]}
        tokens = await strict.tokenize(InferenceRequest("a", "messages", "strict", "strict", body, format=format_of("messages")))
        merged = {"messages": [{"role": "system", "content": "A.B."}, {"role": "user", "content": "hi"}],
                  "add_generation_prompt": True}
        assert tokens == strict.load("strict").encode_chat(merged)
    finally:
        strict.close()
