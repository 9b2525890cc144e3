"""A vLLM-compatible model-server simulator: faithful on everything a router sees.

Start replicas with ``python -m epp.engine.sim fleet --replicas N`` or, from Python,
``async with SimFleet(FleetConfig(replicas=N)) as fleet: fleet.endpoints_arg``.
"""

from epp.engine.sim.engine import EngineConfig, SimEngine, SimRequest
from epp.engine.sim.fleet import (
    FleetConfig,
    SimFleet,
    default_tokenizer_dir,
    start_fleet,
)
from epp.engine.sim.kvcache import KVCache, TierConfig
from epp.engine.sim.profiles import (
    FAST,
    H100_LLAMA3_8B,
    PROFILES,
    LatencyProfile,
    get_profile,
)
from epp.engine.sim.replica_config import ReplicaConfig
from epp.engine.sim.server import REPLICA_HEADER, SimReplica

__all__ = [
    "FAST",
    "H100_LLAMA3_8B",
    "PROFILES",
    "REPLICA_HEADER",
    "EngineConfig",
    "FleetConfig",
    "KVCache",
    "LatencyProfile",
    "ReplicaConfig",
    "SimEngine",
    "SimFleet",
    "SimReplica",
    "SimRequest",
    "TierConfig",
    "default_tokenizer_dir",
    "get_profile",
    "start_fleet",
]
