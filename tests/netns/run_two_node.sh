#!/usr/bin/env bash
# Two Ray nodes on one machine, each in its own network namespace, joined by one veth pair:
#
#   pdc-a: lo + pdc-veth-a 10.200.0.1/30   Ray head, 2 CPUs (node 0: prefill; test_two_node_auto's decode-0
#                                          too), the driver (pytest)
#   pdc-b: lo + pdc-veth-b 10.200.0.2/30   Ray worker, 1 CPU (node 1: decode)
#
# The namespaces have no other interface and no default route, so nothing started in them can reach any
# address but 127.0.0.1 (each its own) and 10.200.0.1/10.200.0.2. Every process started here lives in
# one of them; on exit (normal, error, Ctrl-C, timeout) every process in both namespaces is killed by
# `ip netns pids` and the namespaces (and with them the veth pair) are deleted. No `ray stop`: other Ray
# clusters on this machine are never touched.
#
# Usage (root; iproute2):
#   tests/netns/run_two_node.sh                      # runs tests/netns/test_two_node_auto.py, then
#                                                    # tests/netns/test_two_node.py, in pdc-a
#   tests/netns/run_two_node.sh -- CMD ARGS...       # runs CMD in pdc-a instead (RAY_ADDRESS set)
# Env: PYTHON (default .venv/bin/python), PDC_NETNS_TIMEOUT_S (whole command, default 900).
# Exit status: the command's; 2 if the sandbox refuses a step (the refused command and its error are
# printed).
set -uo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PYTHON")
TIMEOUT_S=${PDC_NETNS_TIMEOUT_S:-900}

export PDC_NETNS_A=pdc-a PDC_NETNS_B=pdc-b PDC_VETH_A=pdc-veth-a PDC_VETH_B=pdc-veth-b
export PDC_IP_A=10.200.0.1 PDC_IP_B=10.200.0.2
RAY_PORT=6379
RAY_TMP_A=/tmp/pdc-netns-a  # Ray's session dirs: not the default /tmp/ray other clusters use
RAY_TMP_B=/tmp/pdc-netns-b
RAY_HOME=/tmp/pdc-netns-home  # HOME of everything started here (our own Ray auth token)

log() { echo "[netns $(date +%H:%M:%S)] $*" >&2; }

# Run one setup step; if the sandbox refuses it, say exactly what and stop.
step() {
    local out
    if ! out=$("$@" 2>&1); then
        log "REFUSED: \`$*\`: ${out:-no message}"
        exit 2
    fi
}

kill_namespace() {
    local ns=$1 pids
    ip netns list 2>/dev/null | grep -qw "^$ns" || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
        kill -TERM $pids 2>/dev/null
        for _ in $(seq 1 50); do  # up to 5 s for a clean exit
            [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
            sleep 0.1
        done
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
        [ -n "${pids// /}" ] && kill -KILL $pids 2>/dev/null
        sleep 0.2
    fi
    ip netns del "$ns" 2>/dev/null
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    kill_namespace "$PDC_NETNS_A"
    kill_namespace "$PDC_NETNS_B"
    ip link del "$PDC_VETH_A" 2>/dev/null  # gone with its namespace; in case it was left in the root one
    rm -rf "$RAY_TMP_A" "$RAY_TMP_B" "$RAY_HOME"
    log "cleaned up: namespaces $PDC_NETNS_A $PDC_NETNS_B deleted, their processes killed"
    exit $rc
}

if [ "$(id -u)" != 0 ]; then
    log "REFUSED: not root (network namespaces need CAP_NET_ADMIN)"
    exit 2
fi
for tool in ip tc timeout; do
    command -v $tool >/dev/null || { log "REFUSED: \`$tool\` not installed (apt-get install iproute2)"; exit 2; }
done
[ -x "$BIN/ray" ] || { log "no $BIN/ray: run \`make install\` first"; exit 2; }

# A previous run killed with SIGKILL may have left our namespaces behind (only ours: by name).
kill_namespace "$PDC_NETNS_A"
kill_namespace "$PDC_NETNS_B"
trap cleanup EXIT
trap 'exit 130' INT TERM

step ip netns add "$PDC_NETNS_A"
step ip netns add "$PDC_NETNS_B"
step ip link add "$PDC_VETH_A" netns "$PDC_NETNS_A" type veth peer name "$PDC_VETH_B" netns "$PDC_NETNS_B"
for side in A B; do
    ns_var=PDC_NETNS_$side veth_var=PDC_VETH_$side ip_var=PDC_IP_$side
    ns=${!ns_var} veth=${!veth_var} addr=${!ip_var}
    step ip -n "$ns" link set lo up
    step ip -n "$ns" addr add "$addr/30" dev "$veth"
    step ip -n "$ns" link set "$veth" up
done
# The link works: one TCP connection from pdc-a to a listener in pdc-b (no ping on this machine).
timeout 10 ip netns exec "$PDC_NETNS_B" "$PYTHON" -c "import socket; s = socket.create_server(('$PDC_IP_B', 5999)); s.settimeout(8); s.accept()" &
step timeout 10 ip netns exec "$PDC_NETNS_A" "$PYTHON" -c "
import socket, time
for _ in range(50):
    try:
        socket.create_connection(('$PDC_IP_B', 5999), timeout=2).close()
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
else:
    raise SystemExit('no listener in $PDC_NETNS_B')"
wait
log "link up: $PDC_NETNS_A/$PDC_VETH_A $PDC_IP_A <-> $PDC_NETNS_B/$PDC_VETH_B $PDC_IP_B; routes in $PDC_NETNS_A:" \
    "$(ip -n "$PDC_NETNS_A" route | tr '\n' ';')"
# What the tc side offers (the test uses what is there; reported, not required).
if out=$(ip netns exec "$PDC_NETNS_A" tc qdisc add dev lo root netem delay 1ms 2>&1); then
    ip netns exec "$PDC_NETNS_A" tc qdisc del dev lo root
    log "tc netem: available"
else
    log "tc netem: REFUSED: \`tc qdisc add dev lo root netem delay 1ms\`: $out"
fi

# Ray: worker processes at the driver's niceness (as pdcluster.driver.ray_runtime does for local clusters);
# no usage-stats upload (there is no route out anyway); no dashboard (CPU).
export RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0 OMP_NUM_THREADS=1
export PATH="$BIN:$PATH"
# Ray 2.60 token authentication, with a token of our own: HOME is a private directory, so neither
# `ray start` nor the driver reads (or writes) the ~/.ray/auth_token other Ray clusters here use.
export HOME=$RAY_HOME RAY_AUTH_MODE=token
mkdir -p "$HOME/.ray" && (umask 077 && "$PYTHON" -c "import secrets; print(secrets.token_hex(32), end='')" >"$HOME/.ray/auth_token")
RAY_START_COMMON=(--disable-usage-stats)  # the head has 2 CPUs (test_two_node_auto: prefill and decode-0), the worker 1
log "starting the Ray head in $PDC_NETNS_A ($PDC_IP_A:$RAY_PORT)"
step timeout 120 ip netns exec "$PDC_NETNS_A" "$BIN/ray" start --head --node-ip-address "$PDC_IP_A" \
    --port "$RAY_PORT" --temp-dir "$RAY_TMP_A" --num-cpus 2 "${RAY_START_COMMON[@]}" --include-dashboard false --resources '{"pdcluster_node_0": 1}'
log "starting the Ray worker in $PDC_NETNS_B ($PDC_IP_B)"
step timeout 120 ip netns exec "$PDC_NETNS_B" "$BIN/ray" start --address "$PDC_IP_A:$RAY_PORT" \
    --node-ip-address "$PDC_IP_B" --temp-dir "$RAY_TMP_B" --num-cpus 1 "${RAY_START_COMMON[@]}" \
    --resources '{"pdcluster_node_1": 1}'

export RAY_ADDRESS="$PDC_IP_A:$RAY_PORT" PDCLUSTER_NETNS=1
# How to start a replacement worker in pdc-b (the test of a cut longer than Ray's node health check).
export PDC_RAY_BIN="$BIN/ray" PDC_RAY_TMP_B="$RAY_TMP_B"
if [ "${1:-}" = "--" ]; then
    shift
    cmd=("$@")
else
    cmd=("$PYTHON" -m pytest -n 0 -s -v -p no:cacheprovider --timeout "$TIMEOUT_S" tests/netns/test_two_node_auto.py tests/netns/test_two_node.py)
fi
log "running in $PDC_NETNS_A (RAY_ADDRESS=$RAY_ADDRESS, bounded by ${TIMEOUT_S} s): ${cmd[*]}"
timeout -k 10 "$TIMEOUT_S" ip netns exec "$PDC_NETNS_A" "${cmd[@]}"
rc=$?
log "command exited with $rc"
exit $rc
