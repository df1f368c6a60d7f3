#!/usr/bin/env bash
# Apply (or with --reverse remove) the megatron-deadpool patch series to a Megatron-LM tree.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR [--reverse]
#
# Accepted trees: a git checkout of tag core_v0.16.1 (commit 55ac708...), or an unpacked
# archive of it. Either way every file the series touches must match its recorded pre-image
# sha256 (patches/files.sha256: pre-image, post-image, path); anything else is refused with
# the name of the file that differs. `git apply --check` runs before anything is written.
# A second run reports "already applied" and exits 0.
set -euo pipefail

PINNED_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
PINNED_TAG=core_v0.16.1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
patch_dir="$here/patches"
manifest="$patch_dir/files.sha256"

die() { echo "apply_patches: error: $*" >&2; exit 2; }

usage() { echo "usage: $0 MEGATRON_LM_DIR [--reverse]" >&2; exit 2; }

dir="" reverse=0
for arg in "$@"; do
  case "$arg" in
    --reverse) reverse=1 ;;
    -h|--help) usage ;;
    -*) die "unknown option $arg" ;;
    *) [ -z "$dir" ] || usage; dir=$arg ;;
  esac
done
[ -n "$dir" ] || usage
[ -d "$dir" ] || die "$dir is not a directory"
dir=$(cd "$dir" && pwd)
[ -f "$dir/megatron/training/training.py" ] || die "$dir is not a Megatron-LM tree (no megatron/training/training.py)"
command -v git >/dev/null || die "git is needed (git apply)"

mapfile -t patches < <(find "$patch_dir" -maxdepth 1 -name '[0-9][0-9][0-9][0-9]-*.patch' | sort)
[ "${#patches[@]}" -gt 0 ] || die "no patches found in $patch_dir"

# git must not discover a repository above the tree (an unpacked archive inside another repo).
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES=$(dirname "$dir")
gitapply() { (cd "$dir" && git apply "$@"); }

if [ -e "$dir/.git" ]; then
  head=$(git -C "$dir" rev-parse HEAD 2>/dev/null) || die "$dir has a .git but git cannot read it"
  [ "$head" = "$PINNED_COMMIT" ] || die "$dir is a git checkout at $head, not tag $PINNED_TAG ($PINNED_COMMIT): the patches are for that tag only (git -C $dir checkout $PINNED_TAG)"
fi

# Which files are at the pre-image, which at the post-image, which at neither.
state_of() {  # prints: pre | post | differs:<path> | missing:<path>
  local pre_all=1 post_all=1 pre post path sum
  while read -r pre post path; do
    [ -f "$dir/$path" ] || { echo "missing:$path"; return; }
    sum=$(sha256sum "$dir/$path" | cut -d' ' -f1)
    [ "$sum" = "$pre" ] || pre_all=0
    [ "$sum" = "$post" ] || post_all=0
    if [ "$sum" != "$pre" ] && [ "$sum" != "$post" ]; then echo "differs:$path"; return; fi
  done < "$manifest"
  if [ $pre_all = 1 ]; then echo pre; elif [ $post_all = 1 ]; then echo post; else echo mixed; fi
}

state=$(state_of)
case "$state" in
  missing:*) die "${state#missing:} is missing from $dir: not an unmodified $PINNED_TAG tree" ;;
  differs:*) die "${state#differs:} in $dir differs from Megatron-LM $PINNED_TAG (sha256 mismatch): refusing to patch a modified or different-version tree" ;;
  mixed) die "$dir is partly patched (some files at the pre-image, some at the post-image): restore it to $PINNED_TAG first" ;;
esac

if [ $reverse = 1 ]; then
  if [ "$state" = pre ]; then echo "apply_patches: not applied in $dir; nothing to reverse"; exit 0; fi
  gitapply --reverse --check "${patches[@]}" || die "git apply --reverse --check failed in $dir"
  gitapply --reverse "${patches[@]}"
  echo "apply_patches: removed ${#patches[@]} patch(es) from $dir"
  exit 0
fi

if [ "$state" = post ]; then
  echo "apply_patches: already applied in $dir"
  exit 0
fi
gitapply --check "${patches[@]}" || die "git apply --check failed in $dir"
gitapply "${patches[@]}"
[ "$(state_of)" = post ] || die "patched files do not match their recorded post-image hashes"
added=$(cat "${patches[@]}" | grep -c '^+[^+]' || true)
echo "apply_patches: applied ${#patches[@]} patch(es) to $dir (+$added lines); next: pip install -e <megatron-deadpool>"
