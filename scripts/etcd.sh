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

start_etcd() {
  local dir="$1" port="${2:-}"
  mkdir -p "$dir"
  still_running etcd "$dir/etcd.pid" && return 1
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
  if ! wait_ready etcd "$client_url" "$dir/etcd.pid" "$dir/etcd.log" \
      env ETCDCTL_API=3 etcdctl --endpoints "$client_url" --dial-timeout 1s endpoint health; then
    stop_etcd "$dir"
    return 1
  fi
  echo "$client_url"
}

stop_etcd() {
  stop_pidfile "$1/etcd.pid"
}

case "${1:-}" in
  install) install_etcd ;;
  start) start_etcd "${2:?usage: etcd.sh start DIR [PORT]}" "${3:-}" ;;
  stop) stop_etcd "${2:?usage: etcd.sh stop DIR}" ;;
  *) echo "usage: $0 install | start DIR [PORT] | stop DIR" >&2; exit 2 ;;
esac
