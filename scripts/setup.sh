#!/usr/bin/env bash
# Installs everything the project needs to build and test, when missing. Idempotent.
source "$(dirname "$0")/common.sh"
ensure_build_deps
log "toolchain: $(cd "$REPO_ROOT" && rustc --version)"
