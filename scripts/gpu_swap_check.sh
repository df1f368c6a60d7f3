#!/usr/bin/env bash
# The NCCL hot swap on one GPU that hosts the whole job, in one call (docs/benchmarks.md "GPU").
#
#   scripts/gpu_swap_check.sh [--carry DIR] [--out DIR] [--budget-s N] [--commit SHA] [--dry-run]
#                             [--counts]
#
# TP2 x PP2 x DP2, 4 nodes x 2 processes + 1 spare node, bf16, NCCL, every process on GPU 0
# in the shared-GPU mode (`deadpool launch --share-gpu`: each process its own NCCL host id,
# the socket transport on loopback; a test layout, not a production one). For the reference
# trainer and Megatron-LM's patched pretrain_gpt.py (core_v0.19.0, --transformer-impl local):
# a failure-free run, then node 1 SIGKILLed at iteration 6 in forward/backward (a pipeline
# send/receive in flight), in the optimizer step (the data-parallel collectives), in the
# mirror job, while the budget lasts (`deadpool bench gpu`, megatron_deadpool/apps/bench_gpu.py).
#
# Needs: Python 3.12 with torch (CUDA) and one GPU. Nothing from the network: the Python
# packages the machine lacks come from DIR/wheels/*.whl (scripts/gpu_carry.sh fills DIR),
# Megatron-LM from DIR/Megatron-LM-core_v0.19.0.tar.gz. Writes OUT/gpu_swap.json (bitwise,
# each recovery's phases, NCCL version and environment, GPU, commit) and OUT/gpu_swap.log
# (every launcher's whole output); prints a table. Exit 0 only if bitwise.
# --dry-run: what it would install and run; nothing is installed or run (no GPU needed).
# --counts: instead of the swaps, issue 51's communicator repair on NCCL at W = 8, 16, 32
# ranks (+ 2 spares) on the one GPU (scripts/gpu_repair_counts.py: per survivor the groups
# kept, shrunk with torch.distributed.shrink_group(SHRINK_ABORT), and made fresh with the
# spares, each with its size and seconds): OUT/gpu_repair_counts.json. About 2-4 minutes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carry="$here/gpu-carry" out="${OUT:-/tmp}/gpu_swap" budget=420 commit="" dry=0 counts=0
die() { echo "gpu_swap_check: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --carry) carry=$(cd "${2:?}" && pwd) || die "--carry $2 is not a folder"; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --budget-s) budget=${2:?}; shift 2 ;;
    --commit) commit=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --counts) counts=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-swap-XXXXXX")  # installed packages and the tree: not in OUT
t0=$(date +%s)
say() { echo "[gpu_swap_check +$(( $(date +%s) - t0 ))s] $*"; }

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

# 1. The packages this Python lacks (module=wheel name), from the carried wheels only.
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
  found=$(find "$carry/wheels" -maxdepth 1 -iname "${name}-*.whl" 2>/dev/null | head -n 1 || true)
  if [ -z "$found" ]; then
    [ "$dry" = 1 ] || die "no wheel for $name in $carry/wheels (scripts/gpu_carry.sh makes them)"
    say "would need a wheel for $name (none in $carry/wheels)"
  else
    wheels+=("$found")
  fi
done
if [ "${#wheels[@]}" -gt 0 ] && [ "$dry" = 0 ]; then
  say "installing ${#wheels[@]} wheel(s) into $work/site: $missing"
  "$py" -m pip install -q --no-index --no-deps --target "$work/site" "${wheels[@]}"
else
  say "packages to install: ${missing:-none}"
fi
export PYTHONPATH="$here${wheels:+:$work/site}${PYTHONPATH:+:$PYTHONPATH}"


# 2. Megatron-LM core_v0.19.0, unpacked and patched (skipped, and said, without the archive).
archive="$carry/Megatron-LM-core_v0.19.0.tar.gz"
[ -f "$archive" ] || archive="$here/../shared/megatron-lm/Megatron-LM-core_v0.19.0.tar.gz"
tree=()
if [ -f "$archive" ]; then
  tar xzf "$archive" -C "$work"
  bash "$here/scripts/apply_patches.sh" "$work/Megatron-LM" >/dev/null
  tree=(--megatron-lm "$work/Megatron-LM")
  say "Megatron-LM core_v0.19.0 unpacked and patched in $work/Megatron-LM"
else
  say "no Megatron-LM archive ($carry/Megatron-LM-core_v0.19.0.tar.gz): reference trainer only"
fi

# 3. The machine, then the runs.
if [ "$dry" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
say "deadpool bench gpu --out $out (budget ${budget}s)"
status=0
extra=()
[ -z "$commit" ] || extra+=(--commit "$commit")
[ "$dry" = 0 ] || extra+=(--dry-run)
"$py" -m megatron_deadpool.apps.cli bench gpu --out "$out" "${tree[@]}" --budget-s "$budget" \
  "${extra[@]}" || status=$?
say "done (exit $status): $out/gpu_swap.json, $out/gpu_swap.log"
rm -rf "$work"
exit "$status"
