"""Routing benchmark: our picker against round-robin and the peer routers on simulated replicas.

Run ``python -m bench.routing run shared-prefix --scale small`` (see bench/README.md).
"""
