#!/usr/bin/env bash
# The run command: installs what is missing, builds, starts offset-svc on 127.0.0.1:50053
# with its RocksDB in ./data/offset, shows CAS-max offsets being written and read over gRPC,
# then keeps serving until Ctrl-C (graceful shutdown flushes the store).
source "$(dirname "$0")/common.sh"
ensure_build_deps
cd "$REPO_ROOT"
log "building (first build compiles RocksDB: about 15 minutes on 2 cores)"
cargo build --locked --release -p offset-svc --bin offset-svc --example offset_demo
BIN="$CARGO_TARGET_DIR/release"
DATA_DIR="${EM_DATA_DIR:-$REPO_ROOT/data}"
LISTEN="${EM_OFFSET_LISTEN:-127.0.0.1:50053}"
mkdir -p "$DATA_DIR"

"$BIN/offset-svc" --listen "$LISTEN" --data-dir "$DATA_DIR/offset" &
SVC_PID=$!
trap 'kill -TERM "$SVC_PID" 2>/dev/null; wait "$SVC_PID" 2>/dev/null' EXIT INT TERM
"$BIN/examples/offset_demo" --endpoint "http://$LISTEN"
log "offset-svc is serving on $LISTEN (data in $DATA_DIR/offset); Ctrl-C to stop"
wait "$SVC_PID"
