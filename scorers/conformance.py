"""Test-only plugins used by the GIE conformance suite: endpoint selection by header, served-endpoint echo."""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    ResponseHeadersHook,
    ResponseInfo,
)

SELECTION_HEADER = "test-epp-endpoint-selection"
SERVED_HEADER = "x-conformance-test-served-endpoint"
MISSING_SERVED = "fail: missing envoy lb metadata"


def _split_entry(entry: str) -> tuple[str, int | None]:
    """`ip`, `ip:port`, `[v6]:port` or bare `v6` → (address, port or None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        return host, int(port) if port.isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, int(port) if port.isdigit() else None
    return entry, None


class HeaderBasedTestingFilter(Filter):
    """Keeps the endpoints listed (IP or ip:port) in header `test-epp-endpoint-selection`, in that order."""

    type_name = "header-based-testing-filter"

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        value = request.headers.get(SELECTION_HEADER, "")
        chosen: list[Endpoint] = []
        seen: set[str] = set()
        for entry in filter(None, (part.strip() for part in value.split(","))):
            address, port = _split_entry(entry)
            for ep in endpoints:
                if ep.address == address and (port is None or ep.port == port) and ep.name not in seen:
                    seen.add(ep.name)
                    chosen.append(ep)
        return chosen


class DestinationEndpointServedVerifier(ResponseHeadersHook):
    """Echoes the endpoint Envoy reports as served into response header `x-conformance-test-served-endpoint`."""

    type_name = "destination-endpoint-served-verifier"

    def on_response_headers(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                            target: Endpoint | None) -> None:
        response.set_headers[SERVED_HEADER] = response.served_endpoint or MISSING_SERVED
