#!/usr/bin/env bash
# Regenerates tcpxd_v1.binpb, the client API's descriptor set the Python example loads.
# Without grpc_tools: `TCPXD_BLESS=1 cargo test --test descriptor` writes the same descriptors (tests/descriptor.rs
# fails when this file is stale).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m grpc_tools.protoc -Iproto --include_imports --descriptor_set_out=examples/tcpxd_v1.binpb proto/tcpxd/v1/tcpxd.proto
