#!/usr/bin/env bash
# Builds everything that needs the GPU (release binary, the integration-test binary, the kernel
# bench) with every kernel required, strips it, and collects it with a runner into the
# git-ignored gpu-bundle/. On the GPU machine (no Rust there) run, from the repository root:
#   bash gpu-bundle/run.sh [all|tests|sanitize|bench|hybridbench|run8b]   logs go to $OUT (or ./gpu-logs)
#   bash gpu-bundle/all.sh     every GPU test, memcheck, synccheck and the bench in one ~10-minute call
#                              (initcheck and racecheck: a second call, see all.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DFLASH_REQUIRE_KERNELS=1
cargo build --release -j2 --bin dflash-engine
test_bin=$(cargo test --release -j2 --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "integration" and m.get("executable"):
        print(m["executable"])')
bench_bin=$(cargo bench -j2 --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kernels" and m.get("executable"):
        print(m["executable"])')
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp target/release/dflash-engine gpu-bundle/dflash-engine
cp "$test_bin" gpu-bundle/integration
cp "$bench_bin" gpu-bundle/bench-kernels
strip gpu-bundle/dflash-engine gpu-bundle/integration gpu-bundle/bench-kernels
cp scripts/gpu-run.sh gpu-bundle/run.sh
cp scripts/sanitize.sh gpu-bundle/sanitize.sh
cp scripts/gpu-all.sh gpu-bundle/all.sh
cp scripts/gpu-models.sh gpu-bundle/models.sh
cp scripts/gpu-pack.sh gpu-bundle/pack.sh
cp tests/reference/bench_fla_gdn.py gpu-bundle/bench_fla_gdn.py
cp scripts/ncu-sass-summary.py gpu-bundle/ncu-sass-summary.py
# flash-linear-attention's wheels for the Gated DeltaNet reference (scripts/fetch-wheels.sh).
if ls .whl/*.whl > /dev/null 2>&1; then mkdir -p gpu-bundle/whl && cp .whl/*.whl gpu-bundle/whl/; fi
du -sh gpu-bundle/*
