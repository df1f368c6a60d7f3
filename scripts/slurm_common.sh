#!/bin/bash
# slurm_common.sh -- what every deadpool batch script shares (perlmutter.sbatch,
# vista.sbatch, cpu-local.sbatch). A batch script sets its centre's knobs, sources this file
# and calls:
#
#   deadpool_prepare        check the knobs, pick the coordinator, ports, secret, output dir
#   deadpool_run FLAGS...   one agent per node (srun), trainer FLAGS after `--` of launch
#   deadpool_finish         the job's exit code: 0 only if summary.json says "ok": true
#
# Run as `bash slurm_common.sh agent -- FLAGS...` it is the per-node srun task: it finds
# its node rank (the batch node is node 0, so the coordinator runs there) and execs
# `deadpool launch --node-rank R ...`.
#
# Knobs (environment; the batch scripts give the centre defaults):
#   ACTIVE_NODES       nodes that train; the other allocated nodes are spare nodes
#   PROCS_PER_NODE     workers per node (one per GPU)
#   PRESET             model preset (configs/presets/NAME.json): `deadpool plan` checks that
#                      the mirror fits host memory and prints the trainer flags
#   TRAINER_FLAGS      instead of PRESET: the trainer flags themselves
#   EXTRA_FLAGS        appended to the trainer flags (e.g. "--train-iters 100")
#   DEADPOOL_REPLICAS  K, buddy copies of every rank's state (1); the plan checks it fits
#   MEGATRON_LM_DIR    a Megatron-LM tree at core_v0.16.1 or core_v0.19.0 (Python 3.12) with patches/ applied: run its
#                      pretrain_gpt.py instead of the reference trainer
#   DEADPOOL_REPO      this repository (default: $SLURM_SUBMIT_DIR)
#   DEADPOOL_PYTHON    the Python that has megatron_deadpool (default: python3 on PATH)
#   DEADPOOL_VENV      a virtualenv to activate first; CONTAINER: srun --container-image
#                      (Perlmutter/Vista: podman-hpc/apptainer users set their own wrapper
#                      in DEADPOOL_PYTHON instead)
#   OUT                the job's output directory: events, logs, summary (default
#                      $SLURM_SUBMIT_DIR/deadpool-$SLURM_JOB_ID)
#   DEADPOOL_COORD_ADDR the batch node's address the other nodes reach it on (default:
#                      $SLURM_LAUNCH_NODE_IPADDR as srun reports it to every task)
#   MASTER_PORT        coordinator store port is MASTER_PORT+1 (default: a free pair)
#   DEADPOOL_FAILURE_DOMAINS  "slurm": each node's failure domain is its leaf switch in
#                      Slurm's topology (scontrol show topology; launch/slurm_topology.py),
#                      written to $OUT/domains.json and passed as --deadpool-failure-domains
#                      file:...: each rank's buddies on other switches. Or blocks:N or
#                      file:PATH, passed as they are. Default: none (the node ring)
#   DEADPOOL_LAUNCH_FLAGS extra `deadpool launch` flags (--inject, --device, ...)
#   DEADPOOL_REQUEUE   N > 0: the last resort under Slurm. The job runs with
#                      --deadpool-fallback-save $OUT/fallback; when DeadPool stops (no spare
#                      left, or a rank lost with every buddy) the batch script requeues the
#                      job (`scontrol requeue`, at most N times: submit with `sbatch
#                      --requeue`, which overrides the scripts' --no-requeue), and the
#                      requeued run adds --deadpool-resume $OUT/fallback when the stopped run
#                      saved an iteration of every rank (else it starts as configured, e.g.
#                      from Megatron-LM's own --load in EXTRA_FLAGS). Default 0: off.
# Account and QOS: `sbatch -A ACCOUNT -q QOS ...` (or SBATCH_ACCOUNT / SBATCH_QOS).

deadpool_die() { echo "deadpool: $*" >&2; exit 2; }

deadpool_free_port_pair() { # a port P with P and P+1 free on this node
  "$DEADPOOL_PYTHON" - <<'EOF'
import socket
while True:
    with socket.socket() as s:
        s.bind(("", 0))
        p = s.getsockname()[1]
    if p >= 65000:
        continue
    try:
        with socket.socket() as s2:
            s2.bind(("", p + 1))
    except OSError:
        continue
    print(p)
    break
EOF
}

deadpool_prepare() {
  : "${SLURM_JOB_ID:?run this under sbatch}" "${SLURM_JOB_NUM_NODES:?}"
  DEADPOOL_REPO=${DEADPOOL_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
  if [ -n "${DEADPOOL_VENV:-}" ]; then
    # shellcheck source=/dev/null
    source "$DEADPOOL_VENV/bin/activate"
  fi
  DEADPOOL_PYTHON=${DEADPOOL_PYTHON:-python3}
  [ -n "${ACTIVE_NODES:-}" ] || deadpool_die "set ACTIVE_NODES"
  [ -n "${PROCS_PER_NODE:-}" ] || deadpool_die "set PROCS_PER_NODE"
  SPARE_NODES=$(( SLURM_JOB_NUM_NODES - ACTIVE_NODES ))
  if [ "$SPARE_NODES" -lt 0 ]; then
    deadpool_die "ACTIVE_NODES=$ACTIVE_NODES exceeds the $SLURM_JOB_NUM_NODES allocated nodes"
  fi
  OUT=${OUT:-${SLURM_SUBMIT_DIR:-$PWD}/deadpool-$SLURM_JOB_ID}
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -d "$OUT/results" ]; then  # a requeued run
    mv "$OUT/results" "$OUT/results-run$((SLURM_RESTART_COUNT - 1))"
  fi
  mkdir -p "$OUT/results"
  # Node 0 (coordinator store + decider) must be the batch node: if the batch node dies
  # Slurm ends the job anyway, so the coordinator adds no failure domain of its own.
  BATCH_NODE=${SLURMD_NODENAME:-$(hostname -s)}
  NODE_ORDER="$BATCH_NODE $(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vxF "$BATCH_NODE" | xargs)"
  MASTER_PORT=${MASTER_PORT:-$(deadpool_free_port_pair)}
  # The job secret: a 0600 file in the output directory, read by each agent.
  DEADPOOL_TOKEN_FILE=$OUT/.deadpool-token
  (umask 077 && "$DEADPOOL_PYTHON" -c 'import secrets; print(secrets.token_hex(16))' \
     > "$DEADPOOL_TOKEN_FILE")
  unset DEADPOOL_TOKEN
  deadpool_trainer_flags
  deadpool_failure_domains
  export DEADPOOL_REPO DEADPOOL_PYTHON ACTIVE_NODES PROCS_PER_NODE SPARE_NODES OUT \
    NODE_ORDER MASTER_PORT DEADPOOL_TOKEN_FILE
  echo "deadpool: job $SLURM_JOB_ID: $ACTIVE_NODES active + $SPARE_NODES spare node(s)" \
       "x $PROCS_PER_NODE; coordinator on batch node $BATCH_NODE" \
       "(${DEADPOOL_COORD_ADDR:-SLURM_LAUNCH_NODE_IPADDR}:$MASTER_PORT+1); output in $OUT"
}

deadpool_failure_domains() { # appends --deadpool-failure-domains to TRAIN_FLAGS
  local spec=${DEADPOOL_FAILURE_DOMAINS:-}
  [ -n "$spec" ] || return 0
  if [ "$spec" = slurm ]; then
    "$DEADPOOL_PYTHON" -m megatron_deadpool.launch.slurm_topology --nodes "$NODE_ORDER" \
      --out "$OUT/domains.json" || deadpool_die "DEADPOOL_FAILURE_DOMAINS=slurm: no domains"
    spec=file:$OUT/domains.json
  fi
  TRAIN_FLAGS+=(--deadpool-failure-domains "$spec")
}

deadpool_trainer_flags() { # fills the array TRAIN_FLAGS
  TRAIN_FLAGS=()
  if [ -n "${TRAINER_FLAGS:-}" ]; then
    read -r -d "" -a TRAIN_FLAGS <<< "$TRAINER_FLAGS" || true
  elif [ -n "${PRESET:-}" ]; then
    # Refuses (non-zero, naming the limit) a layout whose mirror does not fit host memory.
    if ! "$DEADPOOL_PYTHON" -m megatron_deadpool.apps.cli plan --preset "$PRESET" \
        --system "${DEADPOOL_SYSTEM:?}" --nodes "$ACTIVE_NODES" \
        --replicas "${DEADPOOL_REPLICAS:-1}" > "$OUT/plan.txt"; then
      cat "$OUT/plan.txt"
      deadpool_die "deadpool plan refused preset $PRESET on $ACTIVE_NODES node(s)"
    fi
    cat "$OUT/plan.txt"
    local flags
    flags=$("$DEADPOOL_PYTHON" -m megatron_deadpool.apps.cli plan --preset "$PRESET" \
      --system "$DEADPOOL_SYSTEM" --nodes "$ACTIVE_NODES" --replicas "${DEADPOOL_REPLICAS:-1}" \
      --flags)
    read -r -d "" -a TRAIN_FLAGS <<< "$flags" || true
  else
    deadpool_die "set PRESET or TRAINER_FLAGS"
  fi
  if [ -n "${EXTRA_FLAGS:-}" ]; then
    local extra
    read -r -d "" -a extra <<< "$EXTRA_FLAGS" || true
    TRAIN_FLAGS+=("${extra[@]}")
  fi
  printf '%s\n' "${TRAIN_FLAGS[@]}" > "$OUT/trainer_flags.txt"  # what trained, for replays
  TRAIN_FLAGS+=(--deadpool --deadpool-replicas "${DEADPOOL_REPLICAS:-1}"
                --deadpool-events "$OUT/events.jsonl")
  if [ "${DEADPOOL_REQUEUE:-0}" -gt 0 ]; then
    TRAIN_FLAGS+=(--deadpool-fallback-save "$OUT/fallback")
    local saved
    if saved=$(deadpool_fallback_iteration); then
      echo "deadpool: restart ${SLURM_RESTART_COUNT:-0}: resuming from iteration $saved" \
           "in $OUT/fallback"
      TRAIN_FLAGS+=(--deadpool-resume "$OUT/fallback")
    fi
  fi
}

deadpool_fallback_iteration() { # the iteration the last run's fallback save holds for every rank
  "$DEADPOOL_PYTHON" - "$OUT/summary.json" <<'EOF'
import json, sys
try:
    it = json.load(open(sys.argv[1]))["fallback_save"]["iteration"]
except (OSError, ValueError, KeyError, TypeError):
    it = None
print(it if it is not None else "")
sys.exit(0 if it is not None else 1)
EOF
}

# One agent per node. --no-kill: a node that slurmctld marks DOWN does not end the step
# (without it every other task is killed, srun exits 137); --kill-on-bad-exit=0: an agent
# that exits non-zero does not take the others down.
deadpool_run() {
  local srun_flags=(--no-kill --kill-on-bad-exit=0 --nodes="$SLURM_JOB_NUM_NODES"
                    --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}")
  if [ -n "${CONTAINER:-}" ]; then srun_flags+=(--container-image="$CONTAINER"); fi
  DEADPOOL_SRUN_RC=0
  srun "${srun_flags[@]}" bash "$DEADPOOL_REPO/scripts/slurm_common.sh" agent -- "$@" \
    > >(tee -a "$OUT/agents.log") 2>&1 || DEADPOOL_SRUN_RC=$?
  echo "deadpool: srun exited $DEADPOOL_SRUN_RC"
}

deadpool_finish() { # 0 only if node 0 wrote a summary that says ok
  local ok
  ok=$("$DEADPOOL_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["ok"])' \
       "$OUT/summary.json" 2>/dev/null || echo missing)
  echo "deadpool: summary ok: $ok ($OUT/summary.json)"
  [ "$ok" = True ] && return 0
  local restarts=${SLURM_RESTART_COUNT:-0}
  if [ "${DEADPOOL_REQUEUE:-0}" -gt "$restarts" ]; then
    local saved
    saved=$(deadpool_fallback_iteration) || saved=none
    echo "deadpool: requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of" \
         "$DEADPOOL_REQUEUE); fallback save: iteration $saved in $OUT/fallback"
    cp "$OUT/summary.json" "$OUT/summary-run$restarts.json" 2>/dev/null || true
    scontrol requeue "$SLURM_JOB_ID" || echo "deadpool: scontrol requeue failed (was the" \
      "job submitted with sbatch --requeue?)"
  fi
  return 1
}

deadpool_agent() { # the srun task on every node
  local rank=0 n addr script=()
  for n in $NODE_ORDER; do
    [ "$n" = "$SLURMD_NODENAME" ] && break
    rank=$((rank + 1))
  done
  [ "$n" = "$SLURMD_NODENAME" ] || deadpool_die "node $SLURMD_NODENAME is not in '$NODE_ORDER'"
  addr=${DEADPOOL_COORD_ADDR:-${SLURM_LAUNCH_NODE_IPADDR:?}}
  DEADPOOL_TOKEN=$(head -n1 "$DEADPOOL_TOKEN_FILE")
  export DEADPOOL_TOKEN
  if [ -n "${MEGATRON_LM_DIR:-}" ]; then script=(--script "$MEGATRON_LM_DIR/pretrain_gpt.py"); fi
  local launch_flags=()
  if [ -n "${DEADPOOL_LAUNCH_FLAGS:-}" ]; then
    read -r -d "" -a launch_flags <<< "$DEADPOOL_LAUNCH_FLAGS" || true
  fi
  cd "$DEADPOOL_REPO" || exit 2
  exec "$DEADPOOL_PYTHON" -m megatron_deadpool.apps.cli launch --nodes "$ACTIVE_NODES" \
    --procs-per-node "$PROCS_PER_NODE" --spare-nodes "$SPARE_NODES" --node-rank "$rank" \
    --master-addr "$addr" --master-port "$MASTER_PORT" --results-dir "$OUT/results" \
    --summary-json "$OUT/summary.json" "${script[@]}" "${launch_flags[@]}" "$@"
}

if [ "${1:-}" = agent ]; then
  shift
  [ "${1:-}" = -- ] && shift
  deadpool_agent -- "$@"
fi
