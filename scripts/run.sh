#!/usr/bin/env bash
# The run command: installs what is missing, builds the services and emctl, then runs
# `emctl demo` on the embedded local backend: an instance (offset-svc, puller-svc,
# dispatcher-svc) comes up on loopback, 20,000 events are published and consumed with ACKs under
# live progress bars, dispatcher-svc is SIGKILLed part-way and restarted, and a counted summary
# ends it (published, delivered, redelivered, ACKed, dead-lettered, lost, lag). Afterwards an
# instance keeps serving on the well-known ports (dispatcher 127.0.0.1:50051) with data in
# ./data until Ctrl-C, for `emctl publish`, `emctl subscribe` and `emctl offsets`.
#
# Environment: EM_DEMO_EVENTS (default 20000), EM_DEMO_KILL (dispatcher|puller|offset|none),
# EM_DEMO_ONLY=1 (exit after the demo), EM_DATA_DIR (default ./data).
source "$(dirname "$0")/common.sh"
ensure_build_deps
cd "$REPO_ROOT"
# The dev profile, as the tests use: the two README commands share one build of RocksDB and
# every dependency. The hot crates (tokio, h2, hyper, tonic, prost, ...) are optimised even there
# (.cargo/config.toml), which keeps the demo fast; benchmarks build `--release` themselves.
# The selection is the one the test command resolves dependency features for — the whole
# workspace, the SDK's `otel` feature, and the dev-dependencies (which `--examples` brings in) —
# so scripts/test.sh and the test brokers reuse every dependency built here instead of building
# about a hundred of them again with other features.
log "building (the first build compiles RocksDB: about 13 minutes on 2 cores, shared with scripts/test.sh)"
cargo build --workspace --locked --features eventmesh-client/otel --bins --examples
BIN="$CARGO_TARGET_DIR/debug"
DATA_DIR="${EM_DATA_DIR:-$REPO_ROOT/data}"
mkdir -p "$DATA_DIR"

log "emctl demo"
"$BIN/emctl" demo --bin-dir "$BIN" --data-dir "$DATA_DIR" \
  --events "${EM_DEMO_EVENTS:-20000}" --kill "${EM_DEMO_KILL:-dispatcher}"
if [ "${EM_DEMO_ONLY:-0}" = 1 ]; then
  exit 0
fi
log "an instance now serves on 127.0.0.1:50051 (data in $DATA_DIR/instance); try, in another terminal:"
cat >&2 <<HELP
  $BIN/emctl publish --topic orders --count 1000
  $BIN/emctl subscribe --topic orders --group billing --start earliest --count 1000 --quiet
  $BIN/emctl offsets --topic orders
Ctrl-C stops it cleanly.
HELP
exec "$BIN/emctl" up --bin-dir "$BIN" --data-dir "$DATA_DIR/instance"
