#!/usr/bin/env bash
# A real NATS server with JetStream for the side-by-side benchmark (peer-bench/): Debian's
# nats-server (2.9), listening on 127.0.0.1 only, HTTP monitoring off.
#
#   scripts/nats.sh install                # apt-get install nats-server if missing
#   scripts/nats.sh start DIR [PORT]       # start it on DIR (JetStream file store in DIR/store,
#                                          # log, pid file); waits until the port answers with
#                                          # the server's INFO line. PORT: the client port
#                                          # (default: a free one, or the one DIR had).
#   scripts/nats.sh stop DIR               # stop the nats-server started on DIR, by its pid
#
# JetStream runs with its defaults: the file store does not fsync every write (2.9 syncs every
# 2 minutes); nothing here changes that. Starting again on the same DIR keeps the store (a
# restart). Idempotent: install skips what is there, start refuses a DIR whose server is still
# running. The pid is in DIR/nats.pid; the client URL is written to DIR/endpoint and printed on
# the last line of `start`. The Debian package's systemd unit is not used (nor started here).
source "$(dirname "$0")/common.sh"

install_nats() {
  ensure_apt nats-server
}

# Debian installs it in /usr/sbin, which a non-root PATH may lack.
nats_bin() {
  command -v nats-server 2>/dev/null || echo /usr/sbin/nats-server
}

# True once 127.0.0.1:PORT accepts a connection and greets with the NATS `INFO {...}` line.
nats_ready() {
  python3 - "$1" <<'EOF' 2>/dev/null
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1)
    s.settimeout(1)
    line = s.makefile("rb").readline()
    s.close()
    sys.exit(0 if line.startswith(b"INFO ") else 1)
except OSError:
    sys.exit(1)
EOF
}

start_nats() {
  local dir="$1" port="${2:-}"
  mkdir -p "$dir"
  still_running nats-server "$dir/nats.pid" && return 1
  install_nats
  command -v python3 >/dev/null || ensure_apt python3
  # A restart on the same DIR keeps its port, so clients find it where it was.
  if [ -z "$port" ] && [ -f "$dir/port" ]; then
    read -r port <"$dir/port"
  fi
  [ -n "$port" ] || port="$(free_port)"
  echo "$port" >"$dir/port"
  local client_url="nats://127.0.0.1:$port"
  # No -m: the HTTP monitoring port stays off. A systemd host may run Debian's own nats-server
  # on 4222: address and port are explicit.
  "$(nats_bin)" \
    -a 127.0.0.1 \
    -p "$port" \
    -n "em-bench" \
    -js \
    -sd "$dir/store" \
    >"$dir/nats.log" 2>&1 &
  echo $! >"$dir/nats.pid"
  echo "$client_url" >"$dir/endpoint"
  if ! wait_ready nats-server "$client_url" "$dir/nats.pid" "$dir/nats.log" nats_ready "$port"; then
    stop_nats "$dir"
    return 1
  fi
  echo "$client_url"
}

stop_nats() {
  stop_pidfile "$1/nats.pid"
}

case "${1:-}" in
  install) install_nats ;;
  start) start_nats "${2:?usage: nats.sh start DIR [PORT]}" "${3:-}" ;;
  stop) stop_nats "${2:?usage: nats.sh stop DIR}" ;;
  *) echo "usage: $0 install | start DIR [PORT] | stop DIR" >&2; exit 2 ;;
esac
