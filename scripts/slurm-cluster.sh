#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for trying and testing deploy/slurm/.
#
#   scripts/slurm-cluster.sh start  [DIR]   install if needed, start munged, slurmctld, slurmd
#   scripts/slurm-cluster.sh stop   [DIR]   cancel every job, stop the daemons
#   scripts/slurm-cluster.sh status [DIR]   exit 0 when the node is up, print sinfo
#   scripts/slurm-cluster.sh env    [DIR]   print `export SLURM_CONF=...` for the shell
#
# Everything the cluster writes (configuration, munge key and socket, state, spool,
# logs, pid files) lives in DIR, by default $LLM_ANNOTATOR_SLURM_DIR or
# ${TMPDIR:-/tmp}/llm-annotator-slurm. The SLURM commands find this cluster through
# SLURM_CONF, which `start` and `env` print:
#
#   eval "$(scripts/slurm-cluster.sh start)"
#   sbatch --wrap hostname
#
# One node with SLURM_CLUSTER_CPUS CPUs (default 2), one partition `debug` where up to
# 4 jobs share a CPU (the tests run two servers and the annotator on two cores). The
# daemons run as root with proctrack/linuxproc and task/none: no cgroups, no systemd.
# Both `start` and `stop` may be run twice. The Debian packages slurmctld, slurmd,
# slurm-client and munge are installed with apt-get when missing (root only).
set -euo pipefail

readonly READY_TIMEOUT=60 # seconds for the node to become idle after the daemons start
readonly STOP_TIMEOUT=20  # seconds for a daemon to exit after SIGTERM

usage() {
    echo "usage: $0 start|stop|status|env [DIR]" >&2
    exit 2
}

log() {
    echo "slurm-cluster: $*" >&2
}

die() {
    log "error: $*"
    exit 1
}

[[ $# -ge 1 && $# -le 2 ]] || usage
command="$1"
dir="${2:-${LLM_ANNOTATOR_SLURM_DIR:-${TMPDIR:-/tmp}/llm-annotator-slurm}}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd -P)"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

# --- processes ------------------------------------------------------------------

pid_alive() { # pid_alive PIDFILE: whether the process named in PIDFILE runs
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(<"$1")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

stop_pidfile() { # stop_pidfile NAME PIDFILE: SIGTERM, then SIGKILL after STOP_TIMEOUT
    local name="$1" pidfile="$2" pid waited=0
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        return 0
    fi
    pid="$(<"$pidfile")"
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && ((waited < STOP_TIMEOUT * 10)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) ignored SIGTERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    log "stopped $name"
}

# --- installation ------------------------------------------------------------------

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    ((${#missing[@]} == 0)) && return 0
    [[ $EUID -eq 0 ]] || die "missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]})"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    log "installing ${missing[*]}"
    local install=(apt-get install -y -qq --no-install-recommends "${missing[@]}")
    # Package scripts must not start the system's own daemons: ours run from $dir.
    if ! DEBIAN_FRONTEND=noninteractive "${install[@]}" >"$dir/apt.log" 2>&1; then
        apt-get update -qq >>"$dir/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive "${install[@]}" >>"$dir/apt.log" 2>&1 ||
            die "apt-get failed; see $dir/apt.log"
    fi
}

# --- configuration -----------------------------------------------------------------

port_in_use() { # port_in_use PORT: whether something listens on loopback PORT
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port_from() { # free_port_from PORT: the first port from PORT on that nobody listens on
    local port="$1"
    while port_in_use "$port"; do
        port=$((port + 1))
    done
    echo "$port"
}

write_config() {
    local host node ctld_port slurmd_port cpus="${SLURM_CLUSTER_CPUS:-2}"
    host="$(hostname -s)"
    node="$host"
    ctld_port="$(free_port_from "${SLURM_CLUSTER_PORT:-6817}")"
    slurmd_port="$(free_port_from $((ctld_port + 1)))"
    mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
    chmod 0700 "$dir/munge"
    cat >"$conf.tmp" <<EOF
# Written by scripts/slurm-cluster.sh; rewritten at every cold start.
ClusterName=llmannotator
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
# Listen on loopback only (the address of SlurmctldHost and NodeAddr), not on every interface.
CommunicationParameters=NoInAddrAny
# Finished jobs stay visible to squeue/scontrol for 10 minutes (there is no sacct).
MinJobAge=600
KillWait=10
NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    mv -f "$conf.tmp" "$conf"
}

# --- daemons -----------------------------------------------------------------------

start_munged() {
    local key="$dir/munge/munge.key"
    if [[ ! -s "$key" ]]; then
        mungekey --create --keyfile="$key" >/dev/null 2>&1 ||
            dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        chmod 0400 "$key"
    fi
    pid_alive "$dir/munge/munged.pid" && return 0
    rm -f "$dir/munge/munge.socket.2" "$dir/munge/munge.socket.2.lock"
    munged --force \
        --key-file="$key" \
        --socket="$dir/munge/munge.socket.2" \
        --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" ||
        die "munged did not start; see $dir/log/munged.log"
    log "started munged"
}

start_slurmctld() {
    pid_alive "$dir/run/slurmctld.pid" && return 0
    # -c: a cold start, forgetting the jobs of an earlier run of this cluster.
    slurmctld -c -f "$conf" || die "slurmctld did not start; see $dir/log/slurmctld.log"
    log "started slurmctld"
}

start_slurmd() {
    pid_alive "$dir/run/slurmd.pid" && return 0
    slurmd -f "$conf" -N "$(hostname -s)" || die "slurmd did not start; see $dir/log/slurmd.log"
    log "started slurmd"
}

node_state() {
    sinfo --noheader --Node --format='%T' 2>/dev/null | head -n 1
}

wait_ready() {
    local state="" tries=0
    while ((tries < READY_TIMEOUT * 2)); do
        state="$(node_state || true)"
        case "$state" in
            idle | mixed | allocated | completing) return 0 ;;
            down* | drain*)
                scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
                ;;
        esac
        sleep 0.5
        tries=$((tries + 1))
    done
    die "the node is not up after ${READY_TIMEOUT}s (state '${state:-none}'); see $dir/log"
}

cmd_start() {
    install_packages
    if ! pid_alive "$dir/run/slurmctld.pid"; then
        # Nothing of an earlier cluster in $dir may outlive its configuration.
        stop_pidfile slurmd "$dir/run/slurmd.pid"
        write_config
    fi
    start_munged
    start_slurmctld
    start_slurmd
    wait_ready
    log "node $(hostname -s) is $(node_state) (SLURM_CONF=$conf)"
    echo "export SLURM_CONF=$conf"
}

cmd_stop() {
    local jobs waited=0
    if pid_alive "$dir/run/slurmctld.pid"; then
        jobs="$(squeue --noheader --format='%A' 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086 # one job id a word
            scancel $jobs 2>/dev/null || true
            while [[ -n "$(squeue --noheader --format='%A' 2>/dev/null || true)" ]] &&
                ((waited < STOP_TIMEOUT * 2)); do
                sleep 0.5
                waited=$((waited + 1))
            done
        fi
    fi
    stop_pidfile slurmd "$dir/run/slurmd.pid"
    stop_pidfile slurmctld "$dir/run/slurmctld.pid"
    stop_pidfile munged "$dir/munge/munged.pid"
}

cmd_status() {
    local ok=0
    for pair in "munged:$dir/munge/munged.pid" "slurmctld:$dir/run/slurmctld.pid" \
        "slurmd:$dir/run/slurmd.pid"; do
        if pid_alive "${pair#*:}"; then
            log "${pair%%:*} running (pid $(<"${pair#*:}"))"
        else
            log "${pair%%:*} not running"
            ok=1
        fi
    done
    if ((ok == 0)); then
        sinfo >&2 || ok=1
    fi
    return "$ok"
}

case "$command" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) usage ;;
esac
