#!/usr/bin/env bash
# A real Kafka-compatible broker for tests: tansu 0.6.0 (crates.io) with in-memory storage,
# listening on 127.0.0.1 only.
#
#   scripts/kafka.sh install          # build tansu into the tool cache once (about 4 min)
#   scripts/kafka.sh start DIR [PORT] # start it in DIR (logs, pid file); waits until ready
#   scripts/kafka.sh stop DIR         # stop the broker started in DIR, by its pid
#
# Memory storage: every restart starts empty. Idempotent: install skips a matching binary,
# start refuses a DIR whose broker is still running.
source "$(dirname "$0")/common.sh"

TANSU_VERSION=0.6.0
TANSU="$EM_TOOLS/bin/tansu"

install_tansu() {
  if [ -x "$TANSU" ] && "$TANSU" --version 2>/dev/null | grep -q "^tansu $TANSU_VERSION\$"; then
    return 0
  fi
  ensure_apt build-essential pkg-config cmake
  log "building tansu $TANSU_VERSION into $EM_TOOLS (once per machine, about 4 minutes)"
  cargo_install_tool tansu --version "$TANSU_VERSION" --no-default-features --features dynostore
}

start_tansu() {
  local dir="$1" port="${2:-9092}"
  mkdir -p "$dir"
  still_running tansu "$dir/tansu.pid" && return 1
  install_tansu
  # tansu reads a .env file from its working directory: run it in its own empty directory.
  (cd "$dir" && exec "$TANSU" broker \
      --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$port" \
      --storage-engine memory://tansu/ >"$dir/tansu.log" 2>&1) &
  echo $! >"$dir/tansu.pid"
  if ! wait_ready tansu "127.0.0.1:$port" "$dir/tansu.pid" "$dir/tansu.log" \
      bash -c "echo >/dev/tcp/127.0.0.1/$port"; then
    stop_tansu "$dir"
    return 1
  fi
}

stop_tansu() {
  stop_pidfile "$1/tansu.pid"
}

case "${1:-}" in
  install) install_tansu ;;
  start) start_tansu "${2:?usage: kafka.sh start DIR [PORT]}" "${3:-9092}" ;;
  stop) stop_tansu "${2:?usage: kafka.sh stop DIR}" ;;
  *) echo "usage: $0 install | start DIR [PORT] | stop DIR" >&2; exit 2 ;;
esac
