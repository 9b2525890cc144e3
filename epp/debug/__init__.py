"""The operator's view of a running picker: scores of each pick, its state, and replayed picks.

- `scores`: the pick's per-endpoint scores as Envoy `envoy.lb` metadata (`--emit-endpoint-scores`);
- `state`: every plugin's, the endpoints' and the ledger's state as JSON (`GET /debug/state`);
- `explain`: one request run through producers, filters, scorers and picker without booking it;
- `http`: the metrics port's HTTP server, with the `/debug` routes when enabled;
- `cli`: `epp explain`, which asks a running picker and prints the scores as a table.
"""
