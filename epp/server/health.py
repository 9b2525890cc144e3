"""gRPC health (`grpc.health.v1`) with the GIE service names: liveness, readiness, "" and ext_proc."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS_SERVICES = frozenset({"readiness", "", EXT_PROC_SERVICE})

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health_pb2_grpc.HealthServicer):
    """Liveness is always SERVING; the other services follow `is_ready()` (endpoints known, not draining)."""

    def __init__(self, is_ready: Callable[[], bool]) -> None:
        self.is_ready = is_ready

    def status_of(self, service: str) -> int | None:
        """The status of a service name, or None when the name is unknown."""
        if service == "liveness":
            return _SERVING
        if service in READINESS_SERVICES:
            return _SERVING if self.is_ready() else _NOT_SERVING
        return None

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802
        status = self.status_of(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")
