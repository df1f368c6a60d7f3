#!/usr/bin/env bash
# Fill the folder that travels to a lent GPU machine with what scripts/gpu_swap_check.sh
# installs there (that machine reaches no network): the cp312 x86_64 wheels of megatron-core
# 0.19.0, crc32c and what Megatron-LM's training code imports, and the pinned Megatron-LM
# archive. The folder is kept out of git (.git/info/exclude) and carried by the device call.
#
#   scripts/gpu_carry.sh [DIR] [--archive FILE]     (default DIR: gpu-carry; about 25 MB)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir="$here/gpu-carry" archive="$here/../shared/megatron-lm/Megatron-LM-core_v0.19.0.tar.gz"
while [ $# -gt 0 ]; do
  case "$1" in
    --archive) archive=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) dir=$1; shift ;;
  esac
done
[ -f "$archive" ] || { echo "gpu_carry: error: no archive $archive (--archive FILE)" >&2; exit 2; }
mkdir -p "$dir/wheels"
python3 -m pip download -q -d "$dir/wheels" --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --no-deps \
  megatron-core==0.19.0 "crc32c>=2.3" numpy packaging six regex pyyaml einops tqdm psutil \
  pydantic pydantic-core annotated-types typing-extensions typing-inspection
cp "$archive" "$dir/"
if [ -d "$here/.git" ]; then
  mkdir -p "$here/.git/info"
  rel=${dir#"$here"/}
  grep -qxF "/$rel/" "$here/.git/info/exclude" 2>/dev/null || echo "/$rel/" >> "$here/.git/info/exclude"
fi
du -sh "$dir"
