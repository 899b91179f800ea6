#!/usr/bin/env bash
# The run command: installs what is missing, builds, starts offset-svc (127.0.0.1:50053),
# puller-svc on the embedded local backend (127.0.0.1:50052) with data in ./data, and
# dispatcher-svc (127.0.0.1:50051), shows them working (CAS-max offsets; publish, pull,
# watermark alignment on attach; publish, subscribe, ACK, the group watermark), then keeps serving
# until Ctrl-C (graceful shutdown flushes offsets and checkpoints cursors).
source "$(dirname "$0")/common.sh"
ensure_build_deps
cd "$REPO_ROOT"
log "building (the first build compiles RocksDB: about 15 minutes on 2 cores)"
cargo build --locked --release -p offset-svc -p puller-svc -p dispatcher-svc --bins \
  --example offset_demo --example puller_demo --example dispatcher_demo
BIN="$CARGO_TARGET_DIR/release"
DATA_DIR="${EM_DATA_DIR:-$REPO_ROOT/data}"
mkdir -p "$DATA_DIR"

pids=()
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT INT TERM

"$BIN/offset-svc" --listen 127.0.0.1:50053 --metrics-listen 127.0.0.1:9153 --data-dir "$DATA_DIR/offset" &
pids+=($!)
"$BIN/puller-svc" --listen 127.0.0.1:50052 --metrics-listen 127.0.0.1:9152 \
  --offset-svc http://127.0.0.1:50053 --data-dir "$DATA_DIR/puller" &
pids+=($!)
"$BIN/dispatcher-svc" --listen 127.0.0.1:50051 --metrics-listen 127.0.0.1:9151 \
  --puller http://127.0.0.1:50052 --offset-svc http://127.0.0.1:50053 &
pids+=($!)

"$BIN/examples/offset_demo" --endpoint http://127.0.0.1:50053
"$BIN/examples/puller_demo" --puller http://127.0.0.1:50052 --offsets http://127.0.0.1:50053
"$BIN/examples/dispatcher_demo" --dispatcher http://127.0.0.1:50051 --offsets http://127.0.0.1:50053
log "dispatcher-svc on 127.0.0.1:50051, puller-svc on 127.0.0.1:50052 and offset-svc on 127.0.0.1:50053 are serving (data in $DATA_DIR); Ctrl-C to stop"
wait "${pids[@]}"
