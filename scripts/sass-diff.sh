#!/usr/bin/env bash
# Compares the machine code (SASS) of the kernels between a git revision and the working tree,
# function by function: how many instructions differ, and how many of those differ by more than
# a moved branch or call target. A change to kernel code that leaves a function at 0 such
# instructions compiles to the same program for it. That is evidence about a refactor which needs
# no GPU. It proves nothing about a function whose instructions do change.
# Compiles with build.rs's flags (sm_90a cubin, -O3, -std=c++17, -I kernels). Needs nvcc
# (scripts/install-cuda-toolchain.sh) and installs cuobjdump from a pinned pip wheel into the
# git-ignored .toolchain/cuobjdump on first use.
# Usage: scripts/sass-diff.sh REV [kernels/FILE.cu ...]
#   default files: the .cu files that differ from REV (every .cu file when a .cuh header does).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
die() { echo "sass-diff: error: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: scripts/sass-diff.sh REV [kernels/FILE.cu ...]"
rev=$1
shift
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || die "'$rev' is not a commit of this repository"
nvcc="${NVCC:-$repo_root/.toolchain/py/nvidia/cu13/bin/nvcc}"
[ -x "$nvcc" ] || die "no nvcc at $nvcc: run scripts/install-cuda-toolchain.sh (or set NVCC)"
cuobj_dir="$repo_root/.toolchain/cuobjdump"
cuobjdump="$cuobj_dir/nvidia/cu13/bin/cuobjdump"
if [ ! -x "$cuobjdump" ] || [ ! -x "$cuobj_dir/nvidia/cu13/bin/nvdisasm" ]; then
  # cuobjdump runs nvdisasm for -sass. The oldest cuobjdump wheel published for CUDA 13 reads the
  # 13.0 toolchain's cubins, and so does this nvdisasm.
  python3 -m pip install -q --no-deps --target "$cuobj_dir" nvidia-cuda-cuobjdump==13.2.51 \
    nvidia-cuda-nvdisasm==13.5.37 2> /dev/null ||
    die "could not install cuobjdump (pip install nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.5.37)"
fi
export PATH="$cuobj_dir/nvidia/cu13/bin:$PATH"

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  changed=$(git diff --name-only "$rev" -- kernels/)
  if grep -q '\.cuh$' <<< "$changed"; then
    mapfile -t files < <(ls kernels/*.cu)
  else
    mapfile -t files < <(grep '\.cu$' <<< "$changed" || true)
  fi
fi
[ ${#files[@]} -gt 0 ] || { echo "sass-diff: no kernel file differs from $rev"; exit 0; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old"
git archive "$rev" kernels | tar -x -C "$tmp/old"

# One function's SASS with the addresses and the instruction encodings taken out.
sass() { "$cuobjdump" -sass -fun "$2" "$1" | sed 's@/\*[0-9a-f]*\*/@@; s@/\* 0x[0-9a-f]* \*/@@; /^[[:space:]]*$/d'; }
functions() { "$cuobjdump" -sass "$1" | awk '/Function :/ {print $3}'; }
moved='BRA|BSSY|CALL\.REL|WARPSYNC\.COLLECTIVE|NOP'

for f in "${files[@]}"; do
  name=$(basename "$f" .cu)
  [ -f "$f" ] || die "$f: no such file in the working tree"
  old="$tmp/$name.old.cubin" new="$tmp/$name.new.cubin"
  if [ -f "$tmp/old/$f" ]; then
    "$nvcc" -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I "$tmp/old/kernels" -o "$old" "$tmp/old/$f" ||
      die "$f does not compile at $rev"
  fi
  "$nvcc" -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I kernels -o "$new" "$f" ||
    die "$f does not compile in the working tree"
  echo "== $f ($rev -> working tree)"
  for fn in $( { [ -f "$old" ] && functions "$old"; functions "$new"; } | sort -u); do
    if [ ! -f "$old" ] || ! functions "$old" | grep -qx "$fn"; then
      echo "  $fn: new"
      continue
    fi
    if ! functions "$new" | grep -qx "$fn"; then
      echo "  $fn: removed"
      continue
    fi
    sass "$old" "$fn" > "$tmp/a"
    sass "$new" "$fn" > "$tmp/b"
    total=$(diff "$tmp/a" "$tmp/b" | grep -c '^[<>]' || true)
    real=$(diff "$tmp/a" "$tmp/b" | grep '^[<>]' | grep -Ev "$moved" | grep -c . || true)
    echo "  $fn: $(wc -l < "$tmp/a") instructions; $total lines differ, $real by more than a moved target"
  done
done
