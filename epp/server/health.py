"""gRPC health (`grpc.health.v1`) with the service names GIE's and llm-d's probes ask for.

- `liveness`: SERVING while the process answers (a standby under leader election is alive; so is a
  picker that is draining: it must not be restarted mid-drain).
- `readiness`, `""` and the ext_proc service name: ready to take traffic (`is_ready`: endpoints
  known, not draining, the leader under leader election, caught up with its peers).
- `inference-extension`: what the llm-d chart probes for both liveness and readiness when it runs
  one replica: the picker serves its pool (`is_serving`: discovery has synced, not draining). It
  does not wait for a Ready model-server pod, as llm-d's does not: pods that take minutes to load a
  model would otherwise get the picker restarted by the liveness probe over and over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS_SERVICES = frozenset({"readiness", "", EXT_PROC_SERVICE})
# The llm-d router chart's probe service for a single replica (liveness and readiness alike).
CHART_SERVICE = "inference-extension"
SERVICES = ("liveness", *sorted(READINESS_SERVICES), CHART_SERVICE)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health_pb2_grpc.HealthServicer):
    """Liveness is always SERVING; readiness follows `is_ready()`, `inference-extension` `is_serving()`."""

    def __init__(self, is_ready: Callable[[], bool], is_serving: Callable[[], bool] | None = None) -> None:
        self.is_ready = is_ready
        self.is_serving = is_serving or is_ready

    def status_of(self, service: str) -> int | None:
        """The status of a service name, or None when the name is unknown."""
        if service == "liveness":
            return _SERVING
        if service in READINESS_SERVICES:
            return _SERVING if self.is_ready() else _NOT_SERVING
        if service == CHART_SERVICE:
            return _SERVING if self.is_serving() else _NOT_SERVING
        return None

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802
        status = self.status_of(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")
