#!/usr/bin/env bash
# A real etcd for tests and local clusters: Debian's etcd-server (3.4), every URL on 127.0.0.1.
#
#   scripts/etcd.sh install                # apt-get install etcd-server etcd-client if missing
#   scripts/etcd.sh start DIR [PORT]       # start it on DIR (data, log, pid file); waits until
#                                          # `etcdctl endpoint health` answers. PORT: the client
#                                          # port (default: a free one, or the one DIR had).
#   scripts/etcd.sh stop DIR               # stop the etcd started on DIR, by its pid
#
# Starting again on the same DIR keeps the data (a restart). Idempotent: install skips what is
# there, start refuses a DIR whose etcd is still running. The client URL is written to
# DIR/endpoint and printed on the last line of `start`.
source "$(dirname "$0")/common.sh"

install_etcd() {
  ensure_apt etcd-server etcd-client
}

# A free loopback TCP port (asked of the kernel, then released).
free_port() {
  command -v python3 >/dev/null || ensure_apt python3
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_etcd() {
  local dir="$1" port="${2:-}"
  mkdir -p "$dir"
  if [ -f "$dir/etcd.pid" ] && kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
    echo "etcd already running on $dir (pid $(cat "$dir/etcd.pid"))" >&2
    return 1
  fi
  install_etcd
  local peer=""
  # A restart on the same DIR keeps its ports, so clients find it where it was.
  if [ -z "$port" ] && [ -f "$dir/ports" ]; then
    read -r port peer <"$dir/ports"
  fi
  [ -n "$port" ] || port="$(free_port)"
  [ -n "$peer" ] || peer="$(free_port)"
  echo "$port $peer" >"$dir/ports"
  local client_url="http://127.0.0.1:$port" peer_url="http://127.0.0.1:$peer"
  # A systemd host may run Debian's own etcd on 2379/2380: every URL here is explicit.
  etcd \
    --name "em-test" \
    --data-dir "$dir/data" \
    --listen-client-urls "$client_url" \
    --advertise-client-urls "$client_url" \
    --listen-peer-urls "$peer_url" \
    --initial-advertise-peer-urls "$peer_url" \
    --initial-cluster "em-test=$peer_url" \
    --initial-cluster-state new \
    --log-level error \
    --logger zap \
    >"$dir/etcd.log" 2>&1 &
  echo $! >"$dir/etcd.pid"
  echo "$client_url" >"$dir/endpoint"
  for _ in $(seq 1 200); do
    if ETCDCTL_API=3 etcdctl --endpoints "$client_url" --dial-timeout 1s endpoint health \
        >/dev/null 2>&1; then
      log "etcd ready on $client_url (pid $(cat "$dir/etcd.pid"))"
      echo "$client_url"
      return 0
    fi
    kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "etcd did not become healthy on $client_url; log tail:" >&2
  tail -20 "$dir/etcd.log" >&2
  stop_etcd "$dir"
  return 1
}

stop_etcd() {
  local dir="$1" pid
  [ -f "$dir/etcd.pid" ] || return 0
  pid="$(cat "$dir/etcd.pid")"
  # A stopped (SIGSTOP) etcd must be thawed to act on SIGTERM.
  kill -CONT "$pid" 2>/dev/null || true
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/etcd.pid"
}

case "${1:-}" in
  install) install_etcd ;;
  start) start_etcd "${2:?usage: etcd.sh start DIR [PORT]}" "${3:-}" ;;
  stop) stop_etcd "${2:?usage: etcd.sh stop DIR}" ;;
  *) echo "usage: $0 install | start DIR [PORT] | stop DIR" >&2; exit 2 ;;
esac
