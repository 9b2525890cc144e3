"""Anthropic's Messages API (`POST /v1/messages`): the checks on what the picker reads of its body.

The picker reads `model`, `system` (a string or a list of content blocks), `messages` (each a
`role` and a `content` that is a string or a list of content blocks: `text`, `image`,
`tool_use`, `tool_result`, `document`, `thinking`...), `stream` and `cache_salt`. The blocks'
own fields are the model server's to check (vLLM answers 400 for what it does not accept).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vLLM's Messages endpoint takes these roles (Anthropic's API itself only user and assistant).
ROLES = ("user", "assistant", "system")


def _blocks_problem(blocks: list[Any], where: str) -> str | None:
    for i, block in enumerate(blocks):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            return f"{where}[{i}] is not a content block (an object with a string type)"
    return None


def _message_problem(message: Any, where: str) -> str | None:
    if not isinstance(message, Mapping):
        return f"{where} is not an object"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role must be one of {', '.join(ROLES)}"
    content = message.get("content")
    if isinstance(content, str):
        return None
    if isinstance(content, list):
        return _blocks_problem(content, f"{where}.content")
    return f"{where}.content must be a string or a list of content blocks"


def messages_body_problem(body: Mapping[str, Any]) -> str | None:
    """What is wrong with the `system` and `messages` of a Messages body, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "must have valid messages field"
    for i, message in enumerate(messages):
        problem = _message_problem(message, f"messages[{i}]")
        if problem is not None:
            return f"must have valid messages field: {problem}"
    system = body.get("system")
    if system is None or isinstance(system, str):
        return None
    if isinstance(system, list):
        problem = _blocks_problem(system, "system")
        return None if problem is None else f"must have valid system field: {problem}"
    return "must have valid system field: a string or a list of text blocks"
