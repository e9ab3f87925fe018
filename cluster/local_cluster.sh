#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, for tests and trials: a head plus N worker nodes,
# each its own raylet with its own CPUs and a custom resource naming it, all on 127.0.0.1.
#
#   cluster/local_cluster.sh start [N]   # head + N workers (default 2); prints the addresses
#   cluster/local_cluster.sh status
#   cluster/local_cluster.sh kill-node I # SIGKILLs worker node I at once, as if its machine died
#   cluster/local_cluster.sh start-node I # starts worker node I again (after kill-node), as a new node
#   cluster/local_cluster.sh stop        # stops this cluster's processes only
#
# Settings (environment):
#   RAY_PORT=6379 DASHBOARD_PORT=8265   GCS and dashboard/Jobs API ports on 127.0.0.1
#   HEAD_CPUS=1 WORKER_CPUS=1           logical CPUs per node (tests keep these small)
#   OBJECT_STORE_MB=256                 object store per node (Ray's default of 30% of RAM
#                                       per node would overcommit /dev/shm N+1 times)
#   WORKER_RESOURCES='{"slot": 1}'      extra custom resources of every worker node (JSON object),
#                                       e.g. to place one training worker per node
#   RAY_TMP=/tmp/vitpipe-ray-$RAY_PORT  this cluster's temp dir; `stop` finds its processes by it
#
# Token authentication stays on (RAY_AUTH_MODE=token): the token is Ray's usual one
# (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), generated if there is none and
# never printed. Clients (vitpipe submit, ray job submit) find it the same way.
set -eEuo pipefail  # -E: a failure inside a function also runs `start`'s ERR trap

RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
HEAD_CPUS="${HEAD_CPUS:-1}"
WORKER_CPUS="${WORKER_CPUS:-1}"
OBJECT_STORE_MB="${OBJECT_STORE_MB:-256}"
WORKER_RESOURCES="${WORKER_RESOURCES:-}"
RAY_TMP="${RAY_TMP:-/tmp/vitpipe-ray-${RAY_PORT}}"
HOST=127.0.0.1  # loopback only: without it Ray binds the machine's external interface
export RAY_AUTH_MODE=token
# Train V2's placement-group cleaner finds the state API through this; left to guess, with other
# Ray clusters on the machine it can pick another cluster's, and finished runs' groups then leak.
export RAY_API_SERVER_ADDRESS="http://$HOST:$DASHBOARD_PORT"

die() { echo "local_cluster: $*" >&2; exit 1; }

ensure_token() {
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then return; fi
  local path="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [[ ! -s "$path" ]]; then
    [[ -z "${RAY_AUTH_TOKEN_PATH:-}" ]] || die "RAY_AUTH_TOKEN_PATH=$path is missing or empty"
    ray get-auth-token --generate > /dev/null  # stdout is the token: keep it off the terminal
  fi
}

object_store_bytes() { echo $((OBJECT_STORE_MB * 1024 * 1024)); }

free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cluster_pids() {
  # Every Ray process of this cluster carries its temp dir in its arguments, as `=DIR` or `=DIR/...`
  # (not `=DIR0`: another cluster's). One grep over them all, each argument a NUL-ended record; the
  # pattern comes from a file, or grep would find its own arguments.
  local dir
  dir="$(sed 's/[][\.*^$+?(){}|]/\\&/g' <<< "$RAY_TMP")"
  grep -lazEf <(printf '=%s(/|$)\n' "$dir") /proc/[0-9]*/cmdline 2> /dev/null | cut -d/ -f3 || true
}

worker_resources() {
  # {"worker_I": 1} plus WORKER_RESOURCES' entries.
  local extra="${WORKER_RESOURCES// /}"
  [[ -z "$extra" || "$extra" =~ ^\{.*\}$ ]] || die "WORKER_RESOURCES must be a JSON object, got '$WORKER_RESOURCES'"
  extra="${extra#\{}"; extra="${extra%\}}"
  echo "{\"worker_$1\": 1${extra:+, $extra}}"
}

start() {
  local workers="${1:-2}" i
  [[ "$workers" =~ ^[0-9]+$ ]] || die "worker count must be a number, got '$workers'"
  [[ -z "$(cluster_pids)" ]] || die "a cluster with temp dir $RAY_TMP is running; stop it first"
  ensure_token
  mkdir -p "$RAY_TMP"
  trap 'echo "local_cluster: start failed (see $RAY_TMP/start.log); stopping what started" >&2; stop' ERR
  # The dashboard stays on: it serves the Jobs API, and Ray Train V2 needs its state API.
  # Every node's dashboard agent (which runs submitted jobs) gets a free port: the fixed default
  # (52365) is taken by any other Ray on the machine, and the Jobs API then has no agent.
  # Every node starts in a session of its own (setsid), as on its own machine: its raylet's
  # process group is then that node's alone, and `kill-node` can take it down without the others.
  setsid ray start --head --node-ip-address="$HOST" --port="$RAY_PORT" \
    --include-dashboard=true --dashboard-host="$HOST" --dashboard-port="$DASHBOARD_PORT" \
    --num-cpus="$HEAD_CPUS" --object-store-memory="$(object_store_bytes)" --resources='{"head": 1}' \
    --dashboard-agent-listen-port="$(free_port)" \
    --temp-dir="$RAY_TMP" --disable-usage-stats > "$RAY_TMP/start.log"
  # The worker nodes join at once: each `ray start` spends most of its time waiting for its raylet.
  local pids=()
  for ((i = 1; i <= workers; i++)); do start_worker "$i" & pids+=("$!"); done
  for i in "${pids[@]}"; do wait "$i"; done
  trap - ERR
  echo "Ray cluster up: head + $workers worker node(s) on $HOST"
  echo "  RAY_ADDRESS=$HOST:$RAY_PORT"
  echo "  dashboard / Jobs API: http://$HOST:$DASHBOARD_PORT"
  echo "  node resources: head, worker_1 .. worker_$workers${WORKER_RESOURCES:+ (each also $WORKER_RESOURCES)}"
}

start_worker() {
  # Each worker node gets its own temp dir: nodes sharing one would share runtime_resources/,
  # and a worker's runtime-env agent then deletes a job's working_dir under the head's driver.
  setsid ray start --address="$HOST:$RAY_PORT" --node-ip-address="$HOST" \
    --num-cpus="$WORKER_CPUS" --object-store-memory="$(object_store_bytes)" \
    --resources="$(worker_resources "$1")" --dashboard-agent-listen-port="$(free_port)" \
    --temp-dir="$RAY_TMP/worker-$1" --disable-usage-stats >> "$RAY_TMP/start.log"
}

start_node() {
  local i="${1:-}"
  [[ "$i" =~ ^[0-9]+$ ]] || die "start-node needs a worker node number, got '$i'"
  [[ -n "$(cluster_pids)" ]] || die "no cluster with temp dir $RAY_TMP runs; use start"
  [[ -z "$(raylet_pid "$i")" ]] || die "worker node $i runs already"
  ensure_token
  start_worker "$i" || die "worker node $i did not start (see $RAY_TMP/start.log)"
  echo "started worker node $i"
}

raylet_pid() {
  # The raylet whose arguments hold worker node $1's temp dir.
  local pid
  for pid in $(of_kind "$(cluster_pids)" /raylet/raylet); do
    if grep -qaF -- "=${RAY_TMP}/worker-$1/" "/proc/$pid/cmdline" 2> /dev/null; then echo "$pid"; return; fi
  done
}

kill_node() {
  local i="${1:-}" raylet pgid children
  [[ "$i" =~ ^[0-9]+$ ]] || die "kill-node needs a worker node number, got '$i'"
  raylet="$(raylet_pid "$i")"
  [[ -n "$raylet" ]] || die "no raylet of worker node $i runs with temp dir $RAY_TMP"
  pgid="$(ps -o pgid= -p "$raylet" | tr -d ' ')"
  [[ "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]] || die "worker node $i shares this shell's process group"
  # Ray's workers each lead a process group of their own: they go in the same instant as the raylet's group.
  children="$(ps -o pid= --ppid "$raylet" | tr -s ' \n' ' ')"
  # shellcheck disable=SC2086  # one pid per word
  kill -KILL -- "-$pgid" $children 2> /dev/null || true
  echo "killed worker node $i (raylet $raylet, process group $pgid)"
}

status() {
  ray status --address="$HOST:$RAY_PORT"
}

stop() {
  local pids raylets gcs others
  pids="$(cluster_pids)"
  if [[ -z "$pids" ]]; then echo "no Ray processes with temp dir $RAY_TMP"; return 0; fi
  # In order: the raylets (their workers go with them), the head's other processes, the GCS last.
  # Each of them tells the GCS of its end on SIGTERM, and waits up to a minute for a GCS that is gone.
  raylets="$(of_kind "$pids" /raylet/raylet)" gcs="$(of_kind "$pids" /gcs/gcs_server)"
  others="$(grep -vxF -e "${raylets:-none}" -e "${gcs:-none}" <<< "$pids" || true)"
  local group killed=0
  for group in "$raylets" "$others" "$gcs"; do
    terminate "$group" || killed=1
  done
  echo "stopped the Ray cluster in $RAY_TMP$( ((killed)) && echo " (some processes needed SIGKILL)")"
}

of_kind() {
  # The pids among $1 whose executable path contains $2.
  local pid exe
  for pid in $1; do
    exe=""; read -r -d '' exe 2> /dev/null < "/proc/$pid/cmdline" || true
    if [[ "$exe" == *"$2"* ]]; then echo "$pid"; fi
  done
}

alive() {
  # A zombie (ended, not yet reaped: pid 1 of a container may never reap it) has an empty command line.
  local exe=""
  read -r -d '' exe 2> /dev/null < "/proc/$1/cmdline" || true
  [[ -n "$exe" ]]
}

terminate() {
  # SIGTERM to the pids in $1, then SIGKILL to any left after 10 s; false if one needed it.
  local pids="$1" pid left
  [[ -n "$pids" ]] || return 0
  # shellcheck disable=SC2086  # one pid per word
  kill -TERM $pids 2> /dev/null || true
  for _ in $(seq 1 100); do
    left=""
    for pid in $pids; do alive "$pid" && left+=" $pid"; done
    [[ -z "$left" ]] && return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -KILL $left 2> /dev/null || true
  return 1
}

case "${1:-}" in
  start) shift; start "$@" ;;
  status) status ;;
  kill-node) shift; kill_node "$@" ;;
  start-node) shift; start_node "$@" ;;
  stop) stop ;;
  *) echo "usage: $0 start [N] | status | kill-node I | start-node I | stop" >&2; exit 2 ;;
esac
