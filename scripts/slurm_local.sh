#!/usr/bin/env bash
# slurm_local.sh -- a real Slurm cluster on this one Linux host, for tests and CI:
# munged + slurmctld + one `slurmd -N nX` per emulated node (Debian's slurm-wlm is built
# with multiple-slurmd support), loopback only, no systemd, no cgroups, no slurmdbd (finished jobs: a jobcomp file).
# Needs root (slurmd runs jobs as the submitting user).
#
#   scripts/slurm_local.sh install        apt-get install slurmctld slurmd slurm-client munge
#   scripts/slurm_local.sh up             write the config, start the daemons, wait for idle
#   eval "$(scripts/slurm_local.sh env)"  SLURM_CONF for sbatch/srun/sinfo/scontrol
#   scripts/slurm_local.sh status
#   scripts/slurm_local.sh restart-node nX
#   scripts/slurm_local.sh down           stop only what `up` started, by PID
#
# Everything lives under $SLURM_LC_BASE (default /tmp/deadpool-slurm); /etc/slurm and
# /etc/munge are not touched. Ports: SLURM_LC_CTLD_PORT and SLURM_LC_SLURMD_PORTS (a
# space-separated list, one per node); unset ones are picked free at `up` and recorded.
# Tunables: SLURM_LC_NODES (5), SLURM_LC_CPUS (1 per node), SLURM_LC_MEM_MB (2000),
# SLURM_LC_SLURMD_TIMEOUT (10), SLURM_LC_MSG_TIMEOUT (5): with 10/5 slurmctld marks a
# lost node DOWN after about 16-20 s.
# Job scripts: every node's `hostname` is this machine and node names do not resolve;
# use $SLURMD_NODENAME / $SLURM_NODEID and $SLURM_LAUNCH_NODE_IPADDR.
set -euo pipefail

BASE=${SLURM_LC_BASE:-/tmp/deadpool-slurm}
NNODES=${SLURM_LC_NODES:-5}
CPUS=${SLURM_LC_CPUS:-1}
MEM=${SLURM_LC_MEM_MB:-2000}
SLURMD_TIMEOUT=${SLURM_LC_SLURMD_TIMEOUT:-10}
MSG_TIMEOUT=${SLURM_LC_MSG_TIMEOUT:-5}
export SLURM_CONF=$BASE/etc/slurm.conf
# Put into the daemons' environment; slurmstepd inherits it, so `down` can find step
# daemons of THIS cluster that outlived a SIGKILLed slurmd.
TAG="SLURM_LC_TAG=$BASE"
RUN=$BASE/run
MUNGE_SOCK=$BASE/munge/sock/munge.socket

log() { printf '%s [slurm-local] %s\n' "$(date +%T.%3N)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
nodes() { local i; for ((i = 0; i < NNODES; i++)); do echo "n$i"; done; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { cat "$RUN/$1.pid" 2>/dev/null || true; }

free_port() { # a TCP port nobody listens on now (the kernel picks it)
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cmd_install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v sbatch >/dev/null && command -v munged >/dev/null; then
    log "already installed: $(slurmd -V)"; return 0
  fi
  [ "$(id -u)" = 0 ] || die "installing slurm needs root"
  # Without systemd, the packages' postinst calls invoke-rc.d; a policy-rc.d that exits 101
  # keeps it from starting the daemons. Created (and removed) only if absent.
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
  fi
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  log "installed $(slurmd -V)"
}

pick_ports() { # reuse recorded ports, else the env's, else free ones
  if [ -s "$BASE/etc/ports" ]; then
    # shellcheck source=/dev/null
    . "$BASE/etc/ports"
  fi
  CTLD_PORT=${CTLD_PORT:-${SLURM_LC_CTLD_PORT:-$(free_port)}}
  if [ -z "${SLURMD_PORTS:-}" ]; then
    SLURMD_PORTS=${SLURM_LC_SLURMD_PORTS:-}
    local i
    if [ -z "$SLURMD_PORTS" ]; then
      for ((i = 0; i < NNODES; i++)); do SLURMD_PORTS+="$(free_port) "; done
    fi
  fi
  printf 'CTLD_PORT=%s\nSLURMD_PORTS="%s"\n' "$CTLD_PORT" "$SLURMD_PORTS" > "$BASE/etc/ports"
}

write_conf() {
  mkdir -p "$BASE"/{etc,log,run,state/ctld} "$BASE/munge/key" "$BASE/munge/sock"
  # munged: key dir private; socket dir world-searchable (else "Socket is inaccessible")
  chmod 711 "$BASE/munge"; chmod 700 "$BASE/munge/key"; chmod 755 "$BASE/munge/sock"
  if [ ! -s "$BASE/munge/key/munge.key" ]; then
    dd if=/dev/urandom of="$BASE/munge/key/munge.key" bs=1024 count=1 status=none
    chmod 400 "$BASE/munge/key/munge.key"
  fi
  pick_ports
  local n i=0 port
  for n in $(nodes); do mkdir -p "$BASE/state/$n"; done
  {
    cat <<EOF
# written by scripts/slurm_local.sh
ClusterName=deadpoolci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/%n
SlurmctldPidFile=$RUN/slurmctld.daemon.pid
SlurmdPidFile=$RUN/slurmd-%n.daemon.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# finished jobs and their final state, one line each (sacct needs slurmdbd; not here)
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=30
MessageTimeout=$MSG_TIMEOUT
InactiveLimit=0
KillWait=5
# the default requeue re-runs a NODE_FAIL'd batch job ~120 s later over its own output;
# the deadpool scripts also say --no-requeue themselves
JobRequeue=0
# sbatch --wait polls every 2 s only while MinJobAge is small
MinJobAge=2
EOF
    for port in $SLURMD_PORTS; do
      echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
      i=$((i + 1))
    done
    echo "PartitionName=debug Nodes=n[0-$((NNODES - 1))] Default=YES MaxTime=INFINITE State=UP"
  } > "$SLURM_CONF"
}

start_bg() { # name cmd... (daemons run in the foreground, so $! is the daemon itself)
  local name=$1; shift
  env "$TAG" nohup "$@" > "$BASE/log/$name.out" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
  disown $! 2>/dev/null || true
}

start_slurmd() {
  if alive "$(pid_of "slurmd-$1")"; then return 0; fi
  start_bg "slurmd-$1" slurmd -D -N "$1" -f "$SLURM_CONF"
}

node_state() { sinfo -h -n "$1" -o %t 2>/dev/null || true; }

wait_idle() { # timeout_s
  local deadline=$(( $(date +%s) + $1 )) bad
  while :; do
    bad=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 != "idle"' || true)
    if [ -z "$bad" ] && sinfo -h >/dev/null 2>&1; then return 0; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then log "not idle: $bad"; return 1; fi
    sleep 0.5
  done
}

cmd_up() {
  command -v slurmctld >/dev/null || die "slurm is not installed (run: $0 install)"
  write_conf
  local k n
  if ! alive "$(pid_of munged)"; then
    start_bg munged munged -F --socket="$MUNGE_SOCK" --key-file="$BASE/munge/key/munge.key" \
      --pid-file="$RUN/munged.daemon.pid" --seed-file="$BASE/munge/key/munged.seed" \
      --log-file="$BASE/log/munged.log"
    for k in $(seq 50); do [ -S "$MUNGE_SOCK" ] && break; sleep 0.1; done
    munge -S "$MUNGE_SOCK" -n | unmunge -S "$MUNGE_SOCK" >/dev/null || die "munge self-test failed"
  fi
  if ! alive "$(pid_of slurmctld)"; then
    start_bg slurmctld slurmctld -D -c -i -f "$SLURM_CONF"
    for k in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
    scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer; see $BASE/log"
  fi
  for n in $(nodes); do start_slurmd "$n"; done
  wait_idle 60 || die "the cluster did not come up; see $BASE/log"
  log "up: $(sinfo -h -o '%D nodes %t %N'); export SLURM_CONF=$SLURM_CONF"
}

cmd_status() {
  local f p
  for f in "$RUN"/*.pid; do
    case $f in *.daemon.pid) continue ;; esac
    [ -e "$f" ] || continue
    p=$(cat "$f")
    printf '%-14s pid %-7s %s\n' "$(basename "$f" .pid)" "$p" "$(alive "$p" && echo running || echo dead)"
  done
  sinfo -N -l 2>/dev/null || true
  squeue 2>/dev/null || true
}

restart_node() { # nX: start its slurmd again; ReturnToService=2 makes it idle again
  start_slurmd "$1"
  local k
  for k in $(seq 120); do [ "$(node_state "$1")" = idle ] && break; sleep 0.25; done
  log "node $1 is $(node_state "$1") after its slurmd restart"
}

has_env() { # pid VAR=VALUE
  { tr '\0' '\n' < "/proc/$1/environ"; } 2>/dev/null | grep -qxF "$2"
}

stray_pids() { # step daemons of this cluster and job processes that outlived their slurmd
  local p comm
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = "$$" ] && continue
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    if [ "$comm" = slurmstepd ] && has_env "$p" "$TAG"; then echo "$p"; continue; fi
    if has_env "$p" "SLURM_CONF=$SLURM_CONF" &&
       { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -q '^SLURM_JOB_ID='; then
      echo "$p"
    fi
  done
}

is_comm() { # pid comm: a live (not zombie) process with that name?
  [ -n "${1:-}" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] &&
    [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

stop_pid() { # name pid comm: TERM (only if the pid still runs that command), then KILL
  local k
  is_comm "$2" "$3" || return 0
  kill -TERM "$2" 2>/dev/null || true
  for ((k = 0; k < 100; k++)); do is_comm "$2" "$3" || return 0; sleep 0.1; done
  log "$1 ($2) ignored TERM; KILL"
  kill -KILL "$2" 2>/dev/null || true
}

cmd_down() {
  local n p jobs k
  if alive "$(pid_of slurmctld)"; then
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086  # one argument per job id
      scancel $jobs 2>/dev/null || true
      for k in $(seq 40); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  for n in $(nodes); do stop_pid "slurmd-$n" "$(pid_of "slurmd-$n")" slurmd; done
  for p in $(stray_pids); do
    log "killing stray job process $p ($(cat "/proc/$p/comm" 2>/dev/null))"
    kill -KILL "$p" 2>/dev/null || true
  done
  stop_pid slurmctld "$(pid_of slurmctld)" slurmctld
  stop_pid munged "$(pid_of munged)" munged
  rm -f "$RUN"/*.pid
  log "down (logs kept in $BASE)"
}

case ${1:-} in
  install) cmd_install ;;
  up) cmd_up ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  status) cmd_status ;;
  restart-node) restart_node "${2:?node name}" ;;
  down) cmd_down ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
