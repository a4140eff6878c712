#!/usr/bin/env bash
# Start a real SLURM cluster of N emulated nodes on 127.0.0.1 (munged, slurmctld and one slurmd
# per node) for tests and CI. Needs root. Installs slurm-wlm and munge when they are missing.
#
#   slurm/local-cluster/start.sh [--nodes N] [STATE_DIR]
#
# N (or $PRETRAIN_SLURM_NODES; default 1) nodes named node1..nodeN, all on this machine: each
# slurmd runs as `slurmd -N nodeI` on its own port (Debian's slurmd supports several per host),
# each node offers this machine's CPUs. STATE_DIR (or $PRETRAIN_SLURM_DIR; default
# /tmp/pretrain-slurm, whatever TMPDIR says) holds the config, munge key and socket, spool,
# state, logs and PID files. Afterwards `source STATE_DIR/env` exports SLURM_CONF for the
# client commands (sbatch, squeue, scontrol). Ports: $PRETRAIN_SLURM_PORT (slurmctld, default
# 6817) and the next N (the nodes' slurmd).
#
# Running it again while the daemons are up with the same node count changes nothing. With
# another node count it waits until no job is queued or running (other users' jobs are not
# cut short; at most $PRETRAIN_SLURM_WAIT_S seconds, default 600), stops the daemons by their
# PID files and starts the new cluster.
set -euo pipefail

nodes=${PRETRAIN_SLURM_NODES:-1}
if [[ ${1:-} == --nodes ]]; then
    nodes=${2:?start.sh: --nodes needs a count}
    shift 2
fi
state_dir=${1:-${PRETRAIN_SLURM_DIR:-/tmp/pretrain-slurm}}
ctld_port=${PRETRAIN_SLURM_PORT:-6817}
wait_s=${PRETRAIN_SLURM_WAIT_S:-600}
here=$(cd "$(dirname "$0")" && pwd -P)

if ! [[ $nodes =~ ^[1-9][0-9]*$ ]]; then
    echo "start.sh: --nodes $nodes: use a positive whole number" >&2
    exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "start.sh: must run as root (the daemons run as root on this test cluster)" >&2
    exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "start.sh: installing slurm-wlm and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update && apt-get install -y --no-install-recommends slurm-wlm munge
fi

mkdir -p "$state_dir"
state_dir=$(cd "$state_dir" && pwd -P)
conf="$state_dir/slurm.conf"
munge_socket="$state_dir/run/munge.socket"
export SLURM_CONF="$conf"

# munged refuses a group/world-writable directory, and needs the socket's directory open to all.
mkdir -p "$state_dir"/{munge,state,spool,log,run}
chmod 0755 "$state_dir"
chmod 0700 "$state_dir/munge" "$state_dir/state" "$state_dir/spool"

alive() { # alive NAME: the daemon's PID file names a live process
    local pid_file="$state_dir/run/$1.pid"
    [[ -s $pid_file ]] && kill -0 "$(<"$pid_file")" 2>/dev/null
}

if [[ ! -s $state_dir/munge/munge.key ]]; then
    head -c 1024 /dev/urandom >"$state_dir/munge/munge.key"
    chmod 0600 "$state_dir/munge/munge.key"
fi

render_conf() { # the slurm.conf of this cluster, on stdout
    local host measured i
    host=$(hostname -s)
    # What slurmd measures (CPUs, sockets, cores, memory), minus its own NodeName.
    measured=$(slurmd -C | head -n 1 | sed 's/^NodeName=[^ ]* //')
    cat <<EOF
ClusterName=pretrain-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_socket,cred_expire=10
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$state_dir/log/jobcomp.txt
ReturnToService=2
# A node that stops answering is declared down after 15 s (300 s by default), so a test
# that loses a node waits seconds, not minutes.
SlurmdTimeout=15
MinJobAge=600
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool/%n
SlurmctldPidFile=$state_dir/run/slurmctld.pid
SlurmdPidFile=$state_dir/run/slurmd-%n.pid
SlurmctldLogFile=$state_dir/log/slurmctld.log
SlurmdLogFile=$state_dir/log/slurmd-%n.log
EOF
    # One line per node (NodeHostname may not be shared through NodeName=DEFAULT).
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((ctld_port + i))" \
            "$measured State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

wanted=$(render_conf)
if [[ -s $conf && $(<"$conf") != "$wanted" ]]; then
    # Another cluster shape is (or was) running: let its jobs finish, then restart as this one.
    deadline=$((SECONDS + wait_s))
    while alive slurmctld && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; do
        if ((SECONDS >= deadline)); then
            echo "start.sh: jobs are still queued or running after ${wait_s} s; not" \
                "restarting the cluster under them (squeue shows them)" >&2
            exit 1
        fi
        sleep 2
    done
    echo "start.sh: restarting the cluster with $nodes node(s)" >&2
    "$here/stop.sh" "$state_dir" >&2
fi
if [[ ! -s $conf || $(<"$conf") != "$wanted" ]]; then
    printf '%s\n' "$wanted" >"$conf"
fi

printf 'export SLURM_CONF=%q\n' "$conf" >"$state_dir/env"

if ! alive munged; then
    munged --socket="$munge_socket" --key-file="$state_dir/munge/munge.key" \
        --pid-file="$state_dir/run/munged.pid" --log-file="$state_dir/log/munged.log" \
        --seed-file="$state_dir/munge/munged.seed"
fi
if ! alive slurmctld; then
    slurmctld -f "$conf"
fi
for i in $(seq 1 "$nodes"); do
    if ! alive "slurmd-node$i"; then
        slurmd -f "$conf" -N "node$i"
    fi
done

# Ready when the controller answers and every node is idle (or already running jobs).
for _ in $(seq 1 150); do
    ready=$(sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc|comp)$' || true)
    if [[ $ready -eq $nodes ]]; then
        echo "SLURM is up with $nodes node(s): source $state_dir/env"
        exit 0
    fi
    sleep 0.2
done
echo "start.sh: $nodes node(s) did not all become idle in 30 s ($ready ready);" \
    "see $state_dir/log/" >&2
exit 1
