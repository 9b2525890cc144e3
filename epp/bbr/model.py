"""How the body-based router reads a request's model: through the picker's own request parsing.

One function, so that where request parsing lives can change (parser plugins per API format)
without the router changing: it is the one place to point elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework.errors import InferenceError
from epp.request.parsing import RequestParser

_PARSER = RequestParser()


def request_model(headers: Mapping[str, str], body: bytes, parser: RequestParser = _PARSER) -> str:
    """The model a request names ("" when it names none); `InferenceError` for a body the picker would refuse.

    `headers` carry `:path`, which says the API format (OpenAI, Anthropic, vLLM, SGLang...). A
    path no parser reads still has its model read when the body is a JSON object naming one.
    """
    request, _ = parser.parse(request_id="bbr", headers=headers, body=body, subset_hint=None)
    return request.model


def error_body(err: InferenceError, path: str | None, parser: RequestParser = _PARSER) -> bytes:
    """The body of the router's own error answer, in the shape of the path's API (its parser's)."""
    return parser.error_body(err, path)
