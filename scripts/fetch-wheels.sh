#!/usr/bin/env bash
# Downloads the pure-Python wheels the GPU machine lacks (it cannot fetch anything) into the
# git-ignored .whl/: flash-linear-attention 0.6.0 (fla-core + flash-linear-attention) and einops,
# for tests/reference/bench_fla_gdn.py. scripts/gpu-bundle.sh copies them into gpu-bundle/whl/;
# gpu-run.sh installs them there into /tmp/site (no index, no dependencies resolved).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2
ls .whl
