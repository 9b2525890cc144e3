"""The user-input bytes of a request as the approximate prefix cache hashes them (GIE §4.2).

What the bytes are is the request's API format's to say (`InferenceRequest.prompt_bytes`, from
its parser in `epp.scorers.parsers`); these are the names the prefix plugins call them by.
"""

from __future__ import annotations

from epp.framework import InferenceRequest


def user_input_bytes(request: InferenceRequest, limit: int | None = None) -> bytes:
    """The bytes that identify a request's prompt; at most `limit` bytes when a limit is given."""
    return request.prompt_bytes(limit)


def user_input_length(request: InferenceRequest) -> int:
    """Length in bytes of the user input (for token estimates)."""
    return len(request.prompt_bytes())
