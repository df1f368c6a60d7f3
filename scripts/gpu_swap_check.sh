#!/usr/bin/env bash
# The NCCL hot swap on one GPU that hosts the whole job, in one device call (docs/benchmarks.md
# "GPU"), made to answer within the device's limits.
#
#   scripts/gpu_swap_check.sh [--carry DIR] [--out DIR] [--deadline-s N] [--case-cap-s N]
#                             [--cases A,B] [--commit SHA] [--dry-run] [--rehearse] [--counts]
#
# 1. The machine's facts (GPU, driver, /dev/shm's size, which of git/make/gcc exist); the
#    packages this Python lacks from DIR/wheels (no index); Megatron-LM from DIR/Megatron-LM,
#    patched where it was made (scripts/gpu_carry.sh): nothing needs git, a compiler or a
#    package index here, and `make` is stubbed when absent (the dataset helper comes from the
#    megatron-core wheel).
# 2. A 60-second NCCL smoke test (scripts/nccl_smoke.py: 3 processes, each its own
#    NCCL_HOSTID, one all-reduce, NCCL_DEBUG=INFO captured). If it fails, no case runs.
# 3. `deadpool bench gpu`: TP2 x PP2 x DP2, 4 nodes x 2 processes + 1 spare node, bf16, every
#    process on GPU 0 (--share-gpu). Cases in order: failure-free, failure-free again (the
#    determinism control), Megatron-LM's failure-free, then the kills of node 1 at iteration
#    6 (forward/backward, optimizer step, mirror job), Megatron-LM's among the first. Each
#    case has its own cap (--case-cap-s, default 240); a case starts only when the time left
#    is enough; one the deadline cuts is skipped, not failed.
# 4. Whatever happened, OUT holds only gpu_swap.json (deterministic, bitwise per kill case,
#    smoke, NCCL, torch, driver, GPU, commit, each case's seconds), gpu_swap.log.gz (the whole
#    log) and gpu_swap_cases.tar.gz (every case's files); the last 60 lines of the log go to
#    standard output, and OUT is checked against the device's rules (scripts/gpu_outbox.py).
#
# --deadline-s: the whole call ends by then (default 420; leave the device call's timeout
#   30 s more). --dry-run: the plan; nothing installed or run (no GPU needed).
# --rehearse: the whole call on this machine's CPU under the device's rules: git and make
#   off PATH, no package index, a carry made first if --carry names none (the tag this
#   Python runs), the last case cut by a scaled-down deadline (bench gpu --rehearse-cut),
#   and OUT checked; fp32, not bf16 (bf16 matmuls on a CPU without bf16 instructions take
#   about 100x fp32's). Default cases: ref-free, ref-free-again, ref-kill-fwdbwd,
#   ref-kill-optimizer (--cases to change).
# --counts: instead of the swaps, issue 51's communicator repair on NCCL at W = 8, 16, 32
#   (scripts/gpu_repair_counts.py): OUT/gpu_repair_counts.json. About 2-4 minutes.
# Exit 0 only if the finished kill cases are bitwise and the trainer deterministic.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carry="" out="${OUT:-/tmp}/gpu_swap" deadline=420 cap="" commit="" dry=0 counts=0 rehearse=0
cases=""
die() { echo "gpu_swap_check: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --carry) carry=$(cd "${2:?}" && pwd) || die "--carry $2 is not a folder"; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --deadline-s|--budget-s) deadline=${2:?}; shift 2 ;;
    --case-cap-s) cap=${2:?}; shift 2 ;;
    --cases) cases=${2:?}; shift 2 ;;
    --commit) commit=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --counts) counts=1; shift ;;
    --rehearse) rehearse=1; shift ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
py=${PYTHON:-python3}
[ -n "$carry" ] || { [ -d "$here/gpu-carry" ] && carry="$here/gpu-carry"; }
mkdir -p "$out" || die "cannot make $out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-swap-XXXXXX")  # the log, packages, cases: not in OUT
mkdir -p "$work/cases" "$work/bin"
log="$work/gpu_swap.log"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "[gpu_swap_check +$(elapsed)s] $*" | tee -a "$log"; }
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
[ -n "$commit" ] || { [ -n "$carry" ] && [ -f "$carry/COMMIT" ] && commit=$(cat "$carry/COMMIT"); }
# where git is there (a rehearsal, before git leaves PATH): this checkout's commit
[ -n "$commit" ] || commit=$(git -C "$here" rev-parse HEAD 2>/dev/null || true)

if [ "$counts" = 1 ]; then  # issue 51: the repair's counts only (torch and this checkout: nothing carried)
  say "gpu_repair_counts.py --world-sizes 8,16,32 --out $out"
  status=0
  dry_flag=()
  [ "$dry" = 1 ] && dry_flag=(--dry-run)
  "$py" "$here/scripts/gpu_repair_counts.py" --world-sizes 8,16,32 --out "$out" \
    "${dry_flag[@]}" || status=$?
  say "done (exit $status): $out/gpu_repair_counts.json"
  rm -rf "$work"
  exit "$status"
fi

device=cuda
extra=()
if [ "$rehearse" = 1 ]; then
  device=cpu
  [ -n "$cases" ] || cases=ref-free,ref-free-again,ref-kill-fwdbwd,ref-kill-optimizer
  tag=$("$py" -c 'import sys; print("core_v0.19.0" if sys.version_info >= (3, 12) else "core_v0.16.1")')
  if [ "$dry" = 0 ] && [[ "$cases" == *mlm* ]] && [ "$(cat "${carry:-/nonexistent}/TAG" 2>/dev/null)" != "$tag" ]; then
    say "rehearsal: making a carry (tree only) for $tag with git, before git leaves PATH"
    bash "$here/scripts/gpu_carry.sh" "$work/carry" --tag "$tag" --no-wheels >>"$log" 2>&1 \
      || die "scripts/gpu_carry.sh failed (see $log)"
    carry="$work/carry"
  fi
  # PATH without git and make (each PATH folder's other programs linked into one folder)
  mkdir -p "$work/path"
  IFS=: read -r -a dirs <<< "$PATH"
  for d in "${dirs[@]}"; do
    [ -d "$d" ] || continue
    for f in "$d"/*; do
      b=$(basename "$f")
      case "$b" in git|make|gmake) continue ;; esac
      [ -x "$f" ] && [ ! -e "$work/path/$b" ] && ln -s "$f" "$work/path/$b"
    done
  done
  PATH="$work/bin:$work/path"
  export PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/none
  extra+=(--rehearse-cut)
  say "rehearsal on CPU: git $(command -v git >/dev/null && echo present || echo absent), make $(command -v make >/dev/null && echo present || echo absent), no package index"
fi

# shellcheck disable=SC2317  # finish runs from the EXIT trap
finish() {  # OUT: three files whatever happened; the log's tail to standard output
  local rc=$?
  say "packing (call $(elapsed) s, exit ${status:-$rc})"
  "$py" "$here/scripts/gpu_outbox.py" pack --work "$work" --out "$out" \
    --smoke "$work/cases/nccl_smoke.json" --facts "$work/cases/machine.json" || rc=1
  rm -rf "$work"
  exit "${status:-$rc}"
}
[ "$dry" = 1 ] || trap finish EXIT

# 1. The machine.
if [ "$dry" = 0 ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    df -h /dev/shm 2>&1 || true
  } >>"$log"
  "$py" - "$work/cases/machine.json" <<'EOF'
import json, os, shutil, sys, platform
shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
json.dump({"python": platform.python_version(), "cpus": os.cpu_count(),
           "dev_shm_bytes": shm.f_frsize * shm.f_blocks if shm else None,
           "dev_shm_free_bytes": shm.f_frsize * shm.f_bavail if shm else None,
           "tools": {t: shutil.which(t) is not None for t in ("git", "make", "gcc", "nvidia-smi", "tar")}},
          open(sys.argv[1], "w"), indent=1)
EOF
  say "machine: $(tr -d '\n ' < "$work/cases/machine.json")"
fi

# 2. The packages this Python lacks (module=wheel name), from the carried wheels only.
missing=$("$py" - <<'EOF'
import importlib.util as u
need = {"megatron.core": "megatron_core", "crc32c": "crc32c", "numpy": "numpy",
        "packaging": "packaging", "six": "six", "regex": "regex", "yaml": "pyyaml",
        "einops": "einops", "tqdm": "tqdm", "psutil": "psutil",
        "pydantic": "pydantic pydantic_core annotated_types typing_extensions typing_inspection"}
def have(m):
    try:
        return u.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(w for m, w in need.items() if not have(m)))
EOF
)
wheels=()
for name in $missing; do
  found=$(find "${carry:-/nonexistent}/wheels" -maxdepth 1 -iname "${name}-*.whl" 2>/dev/null | head -n 1 || true)
  if [ -z "$found" ]; then
    [ "$dry" = 1 ] || { status=2; say "error: no wheel for $name in ${carry:-(no carry)}/wheels (scripts/gpu_carry.sh makes them)"; exit 2; }
    say "would need a wheel for $name (none in ${carry:-(no carry)}/wheels)"
  else
    wheels+=("$found")
  fi
done
if [ "${#wheels[@]}" -gt 0 ] && [ "$dry" = 0 ]; then
  say "installing ${#wheels[@]} wheel(s) into $work/site: $missing"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "${wheels[@]}" >>"$log" 2>&1 \
    || { status=2; say "error: pip install of the carried wheels failed"; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$work/site"
else
  say "packages to install: ${missing:-none}"
fi

# 3. Megatron-LM: the tree patched where the carry was made (nothing is patched here).
tree=()
if [ -n "$carry" ] && [ -d "$carry/Megatron-LM" ]; then
  if "$py" -c "import sys; from megatron_deadpool.megatron import tree; sys.exit(0 if tree.is_patched(sys.argv[1]) else 1)" "$carry/Megatron-LM"; then
    tree=(--megatron-lm "$carry/Megatron-LM")
    say "Megatron-LM $(cat "$carry/TAG" 2>/dev/null || echo '?'), patched: $carry/Megatron-LM"
  else
    say "Megatron-LM in $carry is not a patched supported tag: reference trainer only"
  fi
else
  say "no Megatron-LM tree (${carry:-no carry}/Megatron-LM; scripts/gpu_carry.sh makes it): reference trainer only"
fi
if ! command -v make >/dev/null; then  # rank 0's compile_helpers() runs `make`; the helper is there
  printf '#!/bin/sh\n# a stand-in: the dataset helper was copied from the megatron-core wheel\nexit 0\n' > "$work/bin/make"
  chmod +x "$work/bin/make"
  PATH="$work/bin:$PATH"
  say "make is absent: stubbed (the dataset helper comes from the megatron-core wheel)"
fi

[ -z "$commit" ] || extra+=(--commit "$commit")
[ -z "$cases" ] || extra+=(--cases "$cases")
[ -z "$cap" ] || extra+=(--case-cap-s "$cap")
if [ "$dry" = 1 ]; then
  if [ "${#tree[@]}" = 0 ]; then  # the plan still shows Megatron-LM's cases
    tree=(--megatron-lm "${carry:-$here/gpu-carry}/Megatron-LM")
    say "dry run: planning Megatron-LM's cases for ${tree[1]} (not there yet)"
  fi
  "$py" -m megatron_deadpool.apps.cli bench gpu --out "$out" "${tree[@]}" --device "$device" \
    --dry-run "${extra[@]}"
  status=$?
  rm -rf "$work"
  exit "$status"
fi

# 4. The smoke test, then the cases in what is left of the deadline (30 s kept for packing).
say "NCCL smoke test (60 s cap, $device)"
smoke=0
"$py" "$here/scripts/nccl_smoke.py" --json "$work/cases/nccl_smoke.json" --log "$log" \
  --timeout-s 60 --device "$device" 2>&1 | tee -a "$log" || smoke=$?
if [ "$smoke" != 0 ]; then
  status=1
  say "the smoke test failed: no case runs (its NCCL output is in the log and the JSON)"
  exit 1
fi
budget=$(( deadline - $(elapsed) - 30 ))
say "deadpool bench gpu (budget ${budget}s, device $device)"
status=0
"$py" -m megatron_deadpool.apps.cli bench gpu --out "$work/cases" --log "$log" "${tree[@]}" \
  --device "$device" --budget-s "$budget" "${extra[@]}" 2>&1 | tee -a "$log" || status=$?
say "bench gpu done (exit $status)"
exit "$status"
