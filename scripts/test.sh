#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole workspace's tests.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p offset-svc`).
source "$(dirname "$0")/common.sh"
ensure_build_deps
cd "$REPO_ROOT"
log "cargo test (target dir: $CARGO_TARGET_DIR)"
cargo test --workspace --locked "$@"
