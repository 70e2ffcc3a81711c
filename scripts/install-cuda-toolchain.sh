#!/usr/bin/env bash
# Installs nvcc (CUDA 13.0) into the repository's git-ignored .toolchain/ from pinned pip wheels,
# so kernels/*.cu can be compiled to sm_90a cubins on a machine without a CUDA install (no GPU
# needed). build.rs finds the result by itself; the last line printed (stdout) is the nvcc path.
#
# Why pip wheels: they are the one CUDA distribution reachable from our build machines. Why all
# five pinned: unpinned wheels pull CUDA 13.5 headers whose PTX the 13.0 ptxas and the GPU
# machine's driver reject. The wheels' own bin/nvcc.profile points nvcc at nvvm/bin/cicc,
# bin/ptxas and the include/ (CUDA, crt) and include/cccl/ headers, so no -I flags or env vars
# are needed. nvcc still needs a host C++ compiler (g++) for preprocessing.
#
# Idempotent: when the pinned set is already installed and nvcc runs, nothing is downloaded.
# Usage: scripts/install-cuda-toolchain.sh [--force]   (PYTHON=... picks the interpreter with pip)
set -euo pipefail

PINNED=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-nvvm==13.0.88
  nvidia-cuda-cccl==13.0.85
)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
toolchain_dir="$repo_root/.toolchain" # build.rs looks exactly here
py_dir="$toolchain_dir/py"
nvcc="$py_dir/nvidia/cu13/bin/nvcc"
# The stamp records exactly which pins were installed: changing PINNED above reinstalls.
stamp="$py_dir/.dflash-pinned"
python="${PYTHON:-python3}"
force=0

log() { echo "install-cuda-toolchain: $*" >&2; }
die() { log "error: $*"; exit 1; }

for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (expected --force or --help)" ;;
  esac
done

# Compiles a tiny bf16 kernel to an sm_90a cubin and checks the ELF magic: proves cicc, ptxas,
# the CUDA headers and the host compiler are all found, with the flags build.rs uses.
smoke_test() {
  local nvcc_bin="$1" tmp
  tmp="$(mktemp -d)"
  cat >"$tmp/smoke.cu" <<'EOF'
#include <cuda_bf16.h>
extern "C" __global__ void smoke(__nv_bfloat16* p, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = __float2bfloat16_rn(__bfloat162float(p[i]) * 2.0f);
}
EOF
  if ! "$nvcc_bin" -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
      -o "$tmp/smoke.cubin" "$tmp/smoke.cu" >"$tmp/log" 2>&1; then
    cat "$tmp/log" >&2
    rm -rf "$tmp"
    return 1
  fi
  local magic
  magic="$(head -c 4 "$tmp/smoke.cubin" | od -An -tx1 | tr -d ' \n')"
  rm -rf "$tmp"
  [[ "$magic" == "7f454c46" ]]
}

want_stamp="$(printf '%s\n' "${PINNED[@]}")"
if [[ $force -eq 0 && -x "$nvcc" && -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]] \
    && "$nvcc" --version >/dev/null 2>&1; then
  log "already installed ($(printf '%s ' "${PINNED[@]}"))"
  echo "$nvcc"
  exit 0
fi

command -v "$python" >/dev/null 2>&1 || die "'$python' not found: install python3 (or set PYTHON)"
"$python" -m pip --version >/dev/null 2>&1 \
  || die "'$python -m pip' does not work: install pip (Debian: apt-get install python3-pip)"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
  || log "warning: no host C++ compiler (g++) on PATH; nvcc needs one (apt-get install g++)"

# Install into a fresh sibling folder and swap it in only once it works, so an interrupted or
# failed install never leaves a half-populated toolchain that the idempotence check would accept.
mkdir -p "$toolchain_dir"
staging="$(mktemp -d "$toolchain_dir/py.staging.XXXXXX")"
chmod 755 "$staging" # mktemp makes it 0700; the toolchain should be usable by every user
trap 'rm -rf "$staging"' EXIT

log "installing ${PINNED[*]} into $py_dir"
start=$SECONDS
# --no-deps: the pins are the complete set; letting pip resolve would pull unpinned 13.x wheels.
# The target is our own folder, so a Debian "externally managed" Python may install there.
PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1 "$python" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
  --only-binary=:all: --target "$staging" "${PINNED[@]}" >&2 \
  || die "pip install failed (needs access to PyPI)"

staged_nvcc="$staging/nvidia/cu13/bin/nvcc"
[[ -x "$staged_nvcc" ]] || die "nvcc not found at $staged_nvcc after pip install; the wheel layout changed?"
smoke_test "$staged_nvcc" || die "the installed nvcc failed to compile an sm_90a cubin (output above)"

printf '%s\n' "$want_stamp" >"$staging/.dflash-pinned"
rm -rf "$py_dir"
mv "$staging" "$py_dir"
trap - EXIT
# Cargo does not rerun build.rs when an nvcc appears after a CPU-only build (it cannot watch a
# path that does not exist yet without rerunning on every build); a newer build.rs mtime makes it.
touch "$repo_root/build.rs"
log "done in $((SECONDS - start)) s: $("$nvcc" --version | tail -1)"
echo "$nvcc"
