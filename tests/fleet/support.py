"""Simulated replicas labelled by model (and GPU) behind the real picker, for the fleet tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from epp.datalayer.registry import EndpointSpec
from epp.engine.sim.fleet import FleetConfig, SimFleet
from epp.engine.sim.server import SimReplica


async def start_fleet(count: int, *, model: str = "model-a", name_prefix: str = "sim", **overrides) -> SimFleet:
    """`count` in-process simulated replicas of `model` (fast profile, no KV events)."""
    fleet = SimFleet(FleetConfig(replicas=count, model=model, kv_events=False, name_prefix=name_prefix, **overrides))
    return await fleet.start()


def spec(replica: SimReplica, **labels: str) -> EndpointSpec:
    """The picker's view of one replica, with its `model` label and any others."""
    host, _, port = replica.endpoint.rpartition(":")
    return EndpointSpec(host, int(port), {"model": replica.config.model, **labels})


def set_wake_seconds(replicas: Sequence[SimReplica], seconds: float) -> None:
    """Give these replicas' profile a wake time (what `/wake_up` takes)."""
    for rep in replicas:
        rep.engine.profile = dataclasses.replace(rep.engine.profile, wake_seconds=seconds)


def config(*plugins: str, profile: Sequence[str] = ()) -> str:
    """An EndpointPickerConfig: GIE's default scorers plus the given plugin lines and profile refs."""
    extra = "".join(f"\n{p}" for p in plugins)
    refs = "".join(f"\n  - pluginRef: {r}" for r in profile)
    return f"""apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer{extra}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3{refs}
"""
