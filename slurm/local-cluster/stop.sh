#!/usr/bin/env bash
# Stop the cluster that start.sh started, by its PID files: SIGTERM, then SIGKILL after 10 s.
#
#   slurm/local-cluster/stop.sh [STATE_DIR]
#
# STATE_DIR as for start.sh. The state directory (config, logs) is kept for inspection.
set -euo pipefail

state_dir=${1:-${PRETRAIN_SLURM_DIR:-/tmp/pretrain-slurm}}

stop() { # stop NAME: terminate the process named by run/NAME.pid, if it is alive
    local pid_file="$state_dir/run/$1.pid" pid
    [[ -s $pid_file ]] || return 0
    pid=$(<"$pid_file")
    if kill -TERM "$pid" 2>/dev/null; then
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "stop.sh: $1 ($pid) ignored SIGTERM; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pid_file"
}

# Compute nodes first (one slurmd per emulated node, and the single-node layout's slurmd.pid
# of older state dirs), controller next, authentication last (the others need it to shut down).
for pid_file in "$state_dir"/run/slurmd*.pid; do
    [[ -e $pid_file ]] || continue
    name=${pid_file##*/}
    stop "${name%.pid}"
done
stop slurmctld
stop munged
echo "SLURM stopped ($state_dir)"
