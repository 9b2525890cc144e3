#!/usr/bin/env bash
# Regenerate the checked-in Python code of the peer protocol from proto/ (needs grpcio-tools, in the
# test extras). tests/peer/test_protocol.py fails when the checked-in code differs from what this makes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/epp/peer/v1/peer.proto
