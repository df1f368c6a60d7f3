#!/usr/bin/env bash
# Fill the folder that travels to a lent GPU machine with what scripts/gpu_swap_check.sh
# uses there (that machine reaches no network and may have no git, make or compiler):
#   DIR/wheels/      cp312 x86_64 wheels of megatron-core 0.16.1 (the reference trainer's) and what Megatron-LM's training
#                    code imports (pydantic and pydantic-core as the pair pydantic names)
#   DIR/Megatron-LM  the pinned Megatron-LM tag, unpacked and patched here
#   DIR/COMMIT       this checkout's commit (there is no git there)
# The folder is kept out of git (.git/info/exclude) and carried by the device call.
#
#   scripts/gpu_carry.sh [DIR] [--tag core_v0.19.0] [--archive FILE] [--no-wheels]
#
# DIR defaults to gpu-carry (about 25 MB). --no-wheels: only the tree (the CPU rehearsal,
# whose Python has the packages already).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir="$here/gpu-carry" tag=core_v0.19.0 archive="" wheels=1
while [ $# -gt 0 ]; do
  case "$1" in
    --archive) archive=${2:?}; shift 2 ;;
    --tag) tag=${2:?}; shift 2 ;;
    --no-wheels) wheels=0; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "gpu_carry: error: unknown option $1" >&2; exit 2 ;;
    *) dir=$1; shift ;;
  esac
done
[ -n "$archive" ] || archive="$here/../shared/megatron-lm/Megatron-LM-$tag.tar.gz"
[ -f "$archive" ] || { echo "gpu_carry: error: no archive $archive (--archive FILE)" >&2; exit 2; }
[ -d "$here/patches/$tag" ] || { echo "gpu_carry: error: no patch series for $tag in patches/" >&2; exit 2; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ "$wheels" = 1 ]; then
  mkdir -p "$dir/wheels"
  # megatron-core as the reference trainer pins it (adapters/lm_rules.py); a Megatron-LM
  # tree imports its own megatron/core first, and the dataset helper's source is the same
  mcore=0.16.1
  dl() { python3 -m pip download -q -d "$dir/wheels" --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --no-deps "$@"; }
  dl "megatron-core==$mcore" "crc32c>=2.3" six regex pyyaml einops tqdm psutil \
    pydantic annotated-types typing-extensions typing-inspection
  # pydantic-core: exactly the version the downloaded pydantic requires (a mismatched pair
  # raises SystemError at import)
  pyd=$(find "$dir/wheels" -maxdepth 1 -name 'pydantic-*.whl' | head -n 1)
  core=$(python3 -c "import sys,zipfile;z=zipfile.ZipFile(sys.argv[1]);m=[n for n in z.namelist() if n.endswith('METADATA')][0];print([l.split('==')[1].split(';')[0].strip() for l in z.read(m).decode().splitlines() if l.startswith('Requires-Dist: pydantic-core==')][0])" "$pyd")
  rm -f "$dir"/wheels/pydantic_core-*.whl
  dl "pydantic-core==$core"
fi
rm -rf "$dir/Megatron-LM"
tar xzf "$archive" -C "$dir"
bash "$here/scripts/apply_patches.sh" "$dir/Megatron-LM" >/dev/null
echo "$tag" > "$dir/TAG"
if [ -d "$here/.git" ] && command -v git >/dev/null; then
  sha=$(git -C "$here" rev-parse HEAD)
  if [ -n "$(git -C "$here" status --porcelain --untracked-files=no)" ]; then sha="$sha dirty"; fi
  echo "$sha" > "$dir/COMMIT"
  rel=${dir#"$here"/}
  if [ "$rel" != "$dir" ]; then
    mkdir -p "$here/.git/info"
    grep -qxF "/$rel/" "$here/.git/info/exclude" 2>/dev/null || echo "/$rel/" >> "$here/.git/info/exclude"
  fi
fi
du -sh "$dir"
