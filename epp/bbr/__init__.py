"""Body-based routing across pools (`epp bbr`): an ext_proc service that names a request's model in headers.

In front of several InferencePools behind one gateway, it reads each request's model from the
body (every API format the picker parses), sets `X-Gateway-Model-Name` (the model asked for) and
`X-Gateway-Base-Model-Name` (the base model of a LoRA adapter, from a mapping an operator keeps in
a mounted ConfigMap, else the model itself), and clears Envoy's route cache, so that a route
matching those headers (an HTTPRoute rule per pool) sends the request to the right pool, whose
picker then chooses the replica.

- `model`: the one function that reads a request's model (the lead's seam to the request parsers);
- `adapters`: the adapter -> base model mapping, its files and their reloading;
- `service`: the ext_proc handler on the project's transport (`epp/server/transport.py`);
- `server`: the process (ext_proc, gRPC health, metrics); `cli`: `epp bbr`;
- `envoy_config`: an Envoy bootstrap with the router in front of one picker per pool.
"""
