"""Simulated replicas labelled by model (and GPU) behind the real picker, for the fleet tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from epp.config.compose import DEFAULT_SCORER_WEIGHTS, PluginDef, endpoint_picker_config
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


def config(*plugins: PluginDef, profile: Sequence[str] = ()) -> str:
    """An EndpointPickerConfig: GIE's default scorers plus the given plugins and profile refs."""
    return endpoint_picker_config([*DEFAULT_SCORER_WEIGHTS, *plugins],
                                  {**DEFAULT_SCORER_WEIGHTS, **dict.fromkeys(profile)})
