#!/usr/bin/env bash
# Write a tag's patch series and its description from a Megatron-LM git checkout whose
# commits after the tag are the DeadPool changes (one commit per patch).
#
#   scripts/export_patches.sh MEGATRON_LM_GIT_DIR TAG [COMMIT]
#
# Writes patches/TAG/: the series (git format-patch TAG..HEAD), COMMIT (the tag's commit;
# COMMIT overrides it, for a checkout made from an archive, `git get-tar-commit-id`) and
# files.sha256 (pre-image sha256, post-image sha256, path of every file the series touches).
# patches/TAG/tag.json (the adapter's data, adapters/tags.py) is written by hand. Check the
# result with scripts/apply_patches.sh on an unmodified tree of TAG.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { echo "export_patches: error: $*" >&2; exit 2; }
if [ $# -lt 2 ] || [ $# -gt 3 ]; then die "usage: $0 MEGATRON_LM_GIT_DIR TAG [COMMIT]"; fi
src=$1 tag=$2
base=$(git -C "$src" rev-parse --verify "$tag^{commit}") || die "$src has no $tag"
commit=${3:-$base}
out="$here/patches/$tag"
mkdir -p "$out"
rm -f "$out"/[0-9][0-9][0-9][0-9]-*.patch
git -C "$src" format-patch -q -o "$out" "$base..HEAD"
echo "$commit" > "$out/COMMIT"
: > "$out/files.sha256"
git -C "$src" diff --name-only "$base" HEAD | sort | while read -r path; do
  pre=$(git -C "$src" show "$base:$path" | sha256sum | cut -d' ' -f1)
  post=$(git -C "$src" show "HEAD:$path" | sha256sum | cut -d' ' -f1)
  echo "$pre  $post  $path" >> "$out/files.sha256"
done
n=$(find "$out" -maxdepth 1 -name '[0-9][0-9][0-9][0-9]-*.patch' | wc -l)
echo "export_patches: $tag: $n patch(es), $(wc -l < "$out/files.sha256") file(s) in $out"
[ -f "$out/tag.json" ] || echo "export_patches: write $out/tag.json (see adapters/tags.py)"
