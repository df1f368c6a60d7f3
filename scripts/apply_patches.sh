#!/usr/bin/env bash
# Apply (or with --reverse remove) the megatron-deadpool patch series to a Megatron-LM tree.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR [--reverse]
#
# One series per pinned tag, in patches/<tag>/ (the patches, COMMIT: the tag's commit,
# files.sha256: pre-image sha256, post-image sha256, path of every file the series touches;
# tag.json is the package's, adapters/tags.py). scripts/export_patches.sh writes a series.
# The tag is found from the tree itself, never from megatron/core/package_info.py: a git
# checkout by its HEAD commit; an unpacked archive by its files' hashes (every file of one
# tag's manifest at that tag's pre-image or post-image). A tree that matches no tag is
# refused, naming the supported tags and the file that differs. `git apply --check` runs
# before anything is written. A second run reports "already applied" and exits 0.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mapfile -t tag_dirs < <(find "$here/patches" -mindepth 1 -maxdepth 1 -type d -name 'core_v*' | sort)
[ "${#tag_dirs[@]}" -gt 0 ] || { echo "apply_patches: error: no series in $here/patches" >&2; exit 2; }
supported=$(for d in "${tag_dirs[@]}"; do printf '%s (%s), ' "$(basename "$d")" "$(head -c 7 "$d/COMMIT")"; done)
supported=${supported%, }

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

# git must not discover a repository above the tree (an unpacked archive inside another repo).
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES=$(dirname "$dir")
gitapply() { (cd "$dir" && git apply "$@"); }

# Which files are at the pre-image, which at the post-image, which at neither.
state_of() {  # state_of MANIFEST; prints: pre | post | mixed | differs:<path> | missing:<path>
  local pre_all=1 post_all=1 pre post path sum
  while read -r pre post path; do
    [ -f "$dir/$path" ] || { echo "missing:$path"; return; }
    sum=$(sha256sum "$dir/$path" | cut -d' ' -f1)
    [ "$sum" = "$pre" ] || pre_all=0
    [ "$sum" = "$post" ] || post_all=0
    if [ "$sum" != "$pre" ] && [ "$sum" != "$post" ]; then echo "differs:$path"; return; fi
  done < "$1"
  if [ $pre_all = 1 ]; then echo pre; elif [ $post_all = 1 ]; then echo post; else echo mixed; fi
}

# The tag: by commit for a git checkout, else the tag whose manifest the files match.
tag_dir="" state=""
if [ -e "$dir/.git" ]; then
  head=$(git -C "$dir" rev-parse HEAD 2>/dev/null) || die "$dir has a .git but git cannot read it"
  for d in "${tag_dirs[@]}"; do
    if [ "$head" = "$(cat "$d/COMMIT")" ]; then tag_dir=$d; fi
  done
  [ -n "$tag_dir" ] || die "$dir is a git checkout at $head, not a supported tag; supported: $supported (git -C $dir checkout <tag>)"
  state=$(state_of "$tag_dir/files.sha256")
else
  nearest=""
  for d in "${tag_dirs[@]}"; do
    s=$(state_of "$d/files.sha256")
    case "$s" in
      pre|post|mixed) tag_dir=$d state=$s; break ;;
      *) nearest="${nearest:+$nearest; }$(basename "$d"): ${s#*:} ${s%%:*}" ;;
    esac
  done
  [ -n "$tag_dir" ] || die "$dir matches no supported Megatron-LM tag (by sha256: $nearest); supported: $supported. Refusing to patch a modified or different-version tree"
fi
tag=$(basename "$tag_dir")
manifest="$tag_dir/files.sha256"
mapfile -t patches < <(find "$tag_dir" -maxdepth 1 -name '[0-9][0-9][0-9][0-9]-*.patch' | sort)
[ "${#patches[@]}" -gt 0 ] || die "no patches found in $tag_dir"

case "$state" in
  missing:*) die "${state#missing:} is missing from $dir: not an unmodified $tag tree" ;;
  differs:*) die "${state#differs:} in $dir differs from Megatron-LM $tag (sha256 mismatch): refusing to patch a modified or different-version tree" ;;
  mixed) die "$dir is partly patched (some files at the pre-image, some at the post-image): restore it to $tag first" ;;
esac

if [ $reverse = 1 ]; then
  if [ "$state" = pre ]; then echo "apply_patches: $tag: not applied in $dir; nothing to reverse"; exit 0; fi
  gitapply --reverse --check "${patches[@]}" || die "git apply --reverse --check failed in $dir"
  gitapply --reverse "${patches[@]}"
  echo "apply_patches: $tag: removed ${#patches[@]} patch(es) from $dir"
  exit 0
fi

if [ "$state" = post ]; then
  echo "apply_patches: $tag: already applied in $dir"
  exit 0
fi
gitapply --check "${patches[@]}" || die "git apply --check failed in $dir"
gitapply "${patches[@]}"
[ "$(state_of "$manifest")" = post ] || die "patched files do not match their recorded post-image hashes"
added=$(cat "${patches[@]}" | grep -c '^+[^+]' || true)
echo "apply_patches: $tag: applied ${#patches[@]} patch(es) to $dir (+$added lines); next: pip install -e <megatron-deadpool>"
