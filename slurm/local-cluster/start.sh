#!/usr/bin/env bash
# Start a real single-node SLURM cluster on 127.0.0.1 (munged, slurmctld, slurmd) for tests
# and CI. Needs root. Installs slurm-wlm and munge when they are missing.
#
#   slurm/local-cluster/start.sh [STATE_DIR]
#
# STATE_DIR (or $PRETRAIN_SLURM_DIR; default /tmp/pretrain-slurm, whatever TMPDIR says) holds the config,
# munge key and socket, spool, state, logs and PID files. Afterwards `source STATE_DIR/env`
# exports SLURM_CONF for the client commands (sbatch, squeue, scontrol). Running it again while
# the daemons are up changes nothing. Ports: $PRETRAIN_SLURM_PORT (slurmctld, default 6817) and
# the next one (slurmd).
set -euo pipefail

state_dir=${1:-${PRETRAIN_SLURM_DIR:-/tmp/pretrain-slurm}}
ctld_port=${PRETRAIN_SLURM_PORT:-6817}
slurmd_port=$((ctld_port + 1))

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

if [[ ! -s $conf ]]; then
    host=$(hostname -s)
    # The node line as slurmd measures it (CPUs, sockets, cores, memory), reached on loopback.
    node_line=$(slurmd -C | head -n 1)
    cat >"$conf" <<EOF
ClusterName=pretrain-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
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
MinJobAge=600
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool/%n
SlurmctldPidFile=$state_dir/run/slurmctld.pid
SlurmdPidFile=$state_dir/run/slurmd.pid
SlurmctldLogFile=$state_dir/log/slurmctld.log
SlurmdLogFile=$state_dir/log/slurmd.log
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
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
if ! alive slurmd; then
    slurmd -f "$conf"
fi

# Ready when the controller answers and the node is idle (or already running jobs).
for _ in $(seq 1 150); do
    node_state=$(sinfo -h -N -o '%t' 2>/dev/null | head -n 1 || true)
    case $node_state in
    idle | mix | alloc | comp)
        echo "SLURM is up: source $state_dir/env"
        exit 0
        ;;
    esac
    sleep 0.2
done
echo "start.sh: the node did not become idle in 30 s (state: '${node_state:-none}');" \
    "see $state_dir/log/" >&2
exit 1
