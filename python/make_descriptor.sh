#!/usr/bin/env bash
# Regenerates src/tcpxd/tcpxd_v1.binpb, the client API's descriptor set the package builds its
# message classes from. Without grpc_tools: `TCPXD_BLESS=1 cargo test -p tcpxd --test suite descriptor::` writes the
# same descriptors (crates/tcpxd/tests/suite/descriptor.rs fails when this file is stale, and python/tests checks it
# against what the daemon's reflection serves).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m grpc_tools.protoc -Iproto --include_imports --descriptor_set_out=python/src/tcpxd/tcpxd_v1.binpb proto/tcpxd/v1/tcpxd.proto
