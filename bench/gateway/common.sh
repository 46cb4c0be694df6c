# What pair.sh, instructions.sh, kernel.sh and added.sh share (sourced, not run): the checks of their
# arguments, the load generator, the scratch directory and the processes stopped on exit, the
# gateway's configuration on loopback ports, the mocks and the wait for a port.

# Every argument an executable equiroute binary, else a message naming the fix, and exit 2.
check_binaries() {
    for b in "$@"; do
        [ -x "$b" ] || { echo "not an executable: $b (build one with: cargo build --release -p equiroute)" >&2; exit 2; }
    done
}

# Every named variable a positive integer, else a message naming it, and exit 2.
check_positive() {
    for v in "$@"; do
        [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "$v must be a positive integer, got '${!v}'" >&2; exit 2; }
    done
}

# Sets OHA to the load generator: OHA_BIN, else oha on PATH, else ~/.cargo/bin/oha.
find_oha() {
    OHA="${OHA_BIN:-$(command -v oha || echo "$HOME/.cargo/bin/oha")}"
    [ -x "$OHA" ] || { echo "oha not found: cargo install oha --locked --version 1.16.0" >&2; exit 2; }
}

# Prints the nginx to run: NGINX_BIN, else nginx on PATH, else /usr/sbin/nginx; nothing when
# there is none.
find_nginx() {
    if [ -n "${NGINX_BIN:-}" ]; then [ -x "$NGINX_BIN" ] && echo "$NGINX_BIN"; return 0; fi
    command -v nginx 2>/dev/null || { [ -x /usr/sbin/nginx ] && echo /usr/sbin/nginx; } || true
}

# Sets WORK to a new scratch directory and PIDS to an empty list; on exit every process in
# PIDS is stopped and WORK removed.
start_work() {
    WORK=$(mktemp -d)
    PIDS=()
    trap stop_work EXIT
}

stop_work() {
    for p in "${PIDS[@]:-}"; do
        [ -n "$p" ] && kill "$p" 2>/dev/null || true
    done
    rm -rf "$WORK"
}

# Writes to FILE a template of this directory (default equiroute.toml) listening on
# 127.0.0.1:LISTEN (default BASE), its three upstreams on the three ports after BASE, with a
# worker per core (@WORKERS@) and PREFIX for @PREFIX@ (nginx.conf's).
write_config() { # BASE FILE [TEMPLATE [LISTEN [PREFIX]]]
    local base=$1
    sed -e "s|@LISTEN@|127.0.0.1:${4:-$base}|" -e "s|@UPSTREAM_1@|127.0.0.1:$((base + 1))|" \
        -e "s|@UPSTREAM_2@|127.0.0.1:$((base + 2))|" -e "s|@UPSTREAM_3@|127.0.0.1:$((base + 3))|" \
        -e "s|@WORKERS@|$(nproc)|g" -e "s|@PREFIX@|${5:-}|g" "$HERE/${3:-equiroute.toml}" >"$2"
}

# --isolate's pinning: this shell (so oha and the mocks it starts later) on every CPU but the
# last, and PIN, a command prefix, for what is to run on the last CPU alone (LAST_CPU). A
# process's default worker count follows the CPUs it may use, so a gateway or nginx started
# under PIN on a 2-core machine runs one loop or worker. Exits 2 without two CPUs or taskset.
isolate_last_cpu() {
    LAST_CPU=$(($(nproc) - 1))
    if [ "$LAST_CPU" -lt 1 ] || ! command -v taskset >/dev/null; then
        echo "--isolate needs two CPUs or more and taskset (util-linux)" >&2
        exit 2
    fi
    taskset -pc "0-$((LAST_CPU - 1))" $$ >/dev/null
    PIN=(taskset -c "$LAST_CPU")
}

# A process's user + system CPU time so far, in clock ticks (/proc/PID/stat; its own threads,
# not its children).
proc_ticks() { # PID
    awk '{print $14 + $15}' "/proc/$1/stat"
}

# Starts BIN's three mocks with PROFILE (a file in this directory) on the three ports after
# BASE, their output in WORK/mockN.log, their PIDs added to PIDS.
start_mocks() { # BIN PROFILE
    for i in 1 2 3; do
        "$1" mock-upstream --listen "127.0.0.1:$((BASE + i))" --profile "$HERE/$2" \
            >"$WORK/mock$i.log" 2>&1 &
        PIDS+=($!)
    done
}

# Returns once something listens on 127.0.0.1:PORT; fails after TRIES tries 0.05 s apart
# (default 100: 5 s).
wait_port() { # PORT [TRIES]
    local tries=${2:-100}
    for _ in $(seq "$tries"); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "nothing listens on 127.0.0.1:$1 after $((tries / 20)) s" >&2
    return 1
}

# The set-up instructions.sh and kernel.sh share: the one-word chat request in WORK/body.json,
# the gateway's configuration on BASE in WORK/equiroute.toml, URL, and BIN's three 0 ms mocks,
# waited for. Then `send N [oha's other arguments]` sends N requests at CONCURRENCY.
start_instant_upstreams() { # BIN
    echo '{"model": "chat", "messages": [{"role": "user", "content": "hello"}]}' >"$WORK/body.json"
    write_config "$BASE" "$WORK/equiroute.toml"
    URL="http://127.0.0.1:$BASE/v1/chat/completions"
    start_mocks "$1" mock-0ms.toml
    for i in 1 2 3; do wait_port $((BASE + i)); done
}

send() { # N, then oha's other arguments
    local n=$1
    shift
    "$OHA" --no-tui -m POST -H content-type:application/json -D "$WORK/body.json" \
        -c "$CONCURRENCY" -n "$n" "$@" "$URL"
}
