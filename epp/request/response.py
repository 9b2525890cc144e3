"""Response-side body handling the picker does for every API: the model name rewritten back.

Usage, the first token and stored response ids are read by the request's parser (its
`RequestFormat`: epp.scorers.parsers).
"""

from __future__ import annotations

import json


class ResponseRewriter:
    """Replaces `"model":"<target>"` by `"model":"<incoming>"` in response bytes, both spacings."""

    def __init__(self, incoming: str, target: str) -> None:
        enc = lambda s: json.dumps(s, ensure_ascii=False).encode()  # noqa: E731
        self.active = incoming != target
        # Built once per request on the hot path: nothing to encode when the model is not rewritten.
        self._pairs = [] if not self.active else [
            (b'"model":' + enc(target), b'"model":' + enc(incoming)),
            (b'"model": ' + enc(target), b'"model": ' + enc(incoming)),
        ]

    def rewrite(self, chunk: bytes) -> bytes:
        if not self.active:
            return chunk
        for old, new in self._pairs:
            chunk = chunk.replace(old, new)
        return chunk
