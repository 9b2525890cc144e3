"""The prefix text of an Anthropic Messages request: what two requests must share to share a cached prefix."""

from __future__ import annotations

import os

from epp.framework import InferenceRequest
from epp.scorers.prompt_text import user_input_bytes
from tests.support.requests import format_of

SYSTEM = [{"type": "text", "text": "You review pull requests. " * 20}]


def messages_request(messages, system=SYSTEM, **body) -> InferenceRequest:
    return InferenceRequest("r", "messages", "m", "m",
                            {"model": "m", "max_tokens": 8, "system": system, "messages": messages, **body}, format=format_of("messages"))


def image(data: str, kind: str = "image") -> dict:
    return {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": data}}


def common_prefix(a: bytes, b: bytes) -> int:
    return len(os.path.commonprefix([a, b]))


def test_system_comes_first_then_tools_then_the_messages_in_order():
    data = user_input_bytes(messages_request([{"role": "user", "content": "first"},
                                              {"role": "assistant", "content": "second"}],
                                             system="sys", tools=[{"name": "grep", "input_schema": {}}]))
    assert data == (b'[{"system":"sys"},{"tools":[{"name":"grep","input_schema":{}}]},'
                    b'{"role":"user","content":"first"},{"role":"assistant","content":"second"}]')


def test_requests_differing_only_by_an_image_part_at_that_image():
    text = {"type": "text", "text": "what changed between these two screenshots?" * 10}
    one = user_input_bytes(messages_request([{"role": "user", "content": [image("A" * 5000), text]}]))
    same = user_input_bytes(messages_request([{"role": "user", "content": [image("A" * 5000), text]}]))
    other = user_input_bytes(messages_request([{"role": "user", "content": [image("B" * 5000), text]}]))
    assert one == same
    diverge = common_prefix(one, other)
    assert one[:diverge].endswith(b'"source":{"digest":"')  # they part inside the image's digest
    # The image is its digest (a few bytes), not its 5000 base64 characters.
    assert len(one) < 1500


def test_documents_are_hashed_by_their_source_too():
    def ask(source_data: str) -> bytes:
        doc = image(source_data, kind="document")
        return user_input_bytes(messages_request([{"role": "user", "content": [doc, {"type": "text", "text": "sum"}]}]))
    assert ask("PDF1") != ask("PDF2")
    assert ask("PDF1") == ask("PDF1")


def test_images_inside_a_tool_result_are_hashed_by_their_source():
    def result(data: str) -> bytes:
        return user_input_bytes(messages_request([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [image(data), {"type": "text", "text": "ok"}]}]}]))
    assert result("A" * 100) != result("B" * 100)
    assert b"A" * 100 not in result("A" * 100)


def test_prompt_caching_marks_and_claude_codes_billing_block_do_not_change_the_prefix():
    turn = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    marked = [{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}]
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f3e;"}, *SYSTEM]
    plain = user_input_bytes(messages_request(turn))
    assert user_input_bytes(messages_request(marked)) == plain
    assert user_input_bytes(messages_request(turn, system=billed)) == plain
    as_string = "x-anthropic-billing-header: cch=1;\nYou review pull requests."
    assert user_input_bytes(messages_request(turn, system=as_string)) == \
        user_input_bytes(messages_request(turn, system="You review pull requests."))


def test_a_longer_conversation_extends_the_shorter_ones_prefix():
    first = [{"role": "user", "content": "fix the bug in parse()"}]
    later = [*first, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                                        "input": {"path": "parse.py"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "def parse(): ..."}]}]
    short, long = user_input_bytes(messages_request(first)), user_input_bytes(messages_request(later))
    assert long.startswith(short[:-1])  # all but the closing bracket
