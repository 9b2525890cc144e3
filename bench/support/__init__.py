"""Pieces the benchmarks share with the tests (tests import them from here; bench never imports tests):

- `redis_server`: a local redis-server on loopback (no persistence), started and killed on demand;
- `k8s_apiserver`: a local Kubernetes API server (list/watch over HTTP) with changes and faults;
- `fuzz_cases`, `fuzz_harness`: seeded random ext_proc streams and the invariants checked per stream;
- `metrics_server`: a loopback HTTP server serving a `/metrics` page a caller can change or slow down;
- `vllm_page`: a synthetic vLLM `/metrics` page of fixed content, so parse and scrape costs compare
  across checkouts (tests scrape pages built on a real vLLM capture: tests/support/vllm_metrics.py).
"""
