"""Data layer: the endpoints of the pool, how they are discovered, and their live metrics."""

from epp.datalayer.registry import EndpointRegistry, EndpointSpec, parse_endpoint_list

__all__ = ["EndpointRegistry", "EndpointSpec", "parse_endpoint_list"]
