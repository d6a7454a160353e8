#!/usr/bin/env bash
# Regenerates the committed Python stubs of prfaas.proto (needs grpcio-tools, the "test" extra).
# Run from anywhere; protoc runs at the repository root so that the stubs import each other as
# prfaas_jax.serving.proto.*. tests/serving/test_proto.py fails when the stubs are stale.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec python -m grpc_tools.protoc -I. \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  prfaas_jax/serving/proto/prfaas.proto
