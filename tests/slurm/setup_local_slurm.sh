#!/usr/bin/env bash
# A one-machine Slurm cluster for the tests: this host is both controller and compute node.
#   tests/slurm/setup_local_slurm.sh [STATE_DIR]      (default /tmp/megaformer-slurm)
# Installs Debian's slurmctld / slurmd / slurm-client / munge when they are missing (needs root and
# apt), writes STATE_DIR/slurm.conf (cgroup-free: proctrack/linuxproc, task/none), starts munged,
# slurmctld and slurmd (or reuses the ones a previous call started) and waits for the node to be idle.
# Clients then need SLURM_CONF=STATE_DIR/slurm.conf; /etc/slurm is never touched.
# Every daemon it starts is listed in STATE_DIR/started.pids: tests/slurm/stop_local_slurm.sh
# STATE_DIR stops exactly those (a munged that was already running is left alone).
# Exit 0: ready.  Exit 77: Slurm cannot be installed or started here; the last line says why.
set -uo pipefail
STATE=${1:-/tmp/megaformer-slurm}
CONF=$STATE/slurm.conf
skip() { echo "SKIP: $*"; exit 77; }
mkdir -p "$STATE"
# started NAME PIDFILE: remember a daemon this script started (waits up to 5 s for its pid file)
started() {
  for _ in $(seq 50); do [ -s "$2" ] && break; sleep 0.1; done
  [ -s "$2" ] && echo "$1 $(cat "$2")" >> "$STATE/started.pids"
}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
  [ "$(id -u)" -eq 0 ] || skip "Slurm is not installed and installing it needs root"
  command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -q && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge; } \
    > "/tmp/megaformer-slurm-apt.log" 2>&1 \
    || skip "apt-get install slurmctld slurmd slurm-client munge failed (see /tmp/megaformer-slurm-apt.log)"
fi
[ "$(id -u)" -eq 0 ] || skip "starting slurmd needs root"

# munge: a key, and munged running as the munge user
if ! { [ -S /run/munge/munge.socket.2 ] && timeout 5 munge -n </dev/null >/dev/null 2>&1; }; then
  if [ ! -s /etc/munge/munge.key ]; then
    (command -v mungekey >/dev/null && mungekey --create --force) \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge
  rm -f /run/munge/munged.pid  # a stale one would be taken for the new daemon's
  runuser -u munge -- /usr/sbin/munged --force || skip "munged did not start"
  started munged /run/munge/munged.pid
fi
(timeout 10 munge -n | timeout 10 unmunge) >/dev/null 2>&1 || skip "munge does not answer"

HOST=$(hostname -s)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS
mkdir -p "$STATE/ctld" "$STATE/d"
export SLURM_CONF=$CONF
if ! scontrol ping 2>/dev/null | grep -q UP; then
  cat > "$CONF" <<CONF
# written by megaformer tests/slurm/setup_local_slurm.sh
ClusterName=megaformer
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldPort=6917
SlurmdPort=6918
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
KillWait=10
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  rm -f "$STATE/slurmctld.pid" "$STATE/slurmd.pid"
  slurmctld -f "$CONF" || skip "slurmctld did not start (see $STATE/slurmctld.log)"
  started slurmctld "$STATE/slurmctld.pid"
  slurmd -f "$CONF" || skip "slurmd did not start (see $STATE/slurmd.log)"
  started slurmd "$STATE/slurmd.pid"
fi
for _ in $(seq 100); do
  state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -1)
  case "$state" in idle|mix|alloc) echo "Slurm ready: node $HOST ($CPUS CPUs), SLURM_CONF=$CONF"; exit 0 ;; esac
  sleep 0.2
done
skip "the Slurm node $HOST did not become idle (state '${state:-none}'; see $STATE/*.log)"
