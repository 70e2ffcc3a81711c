#!/usr/bin/env bash
# Builds the kernel bench of another revision into the GPU bundle, so that one device call can
# time both builds back to back: run-to-run differences between calls (clocks under the power cap,
# another H200) are as large as the 2-3% a kernel change may cost, and only a same-call comparison
# sees it (the drafter backward's 6.065 against 5.916 ms was found this way).
# Usage (after scripts/gpu-bundle.sh): scripts/bench-at.sh [--engine] REV
#   -> gpu-bundle/bench-kernels-<short rev>; on the GPU machine, e.g.
#   for b in bench-kernels-<rev> bench-kernels; do DFLASH_BENCH_KERNELS=attention gpu-bundle/$b; done
#   --engine: REV's engine instead, as gpu-bundle/dflash-engine-<short rev> (~15 MB), which
#   `run.sh ab8b` runs in turn with the bundle's own to time the 8B step of both builds (the
#   bundle, the working tree and what it carries must stay under the device call's 64 MiB).
# The revision is checked out in a git worktree under /tmp and built with its own target folder
# (seeded from this one's release build, so dependencies are not rebuilt); NVCC as for the bundle.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
engine=0
if [ "${1:-}" = --engine ]; then engine=1; shift; fi
rev=$(git rev-parse --short "${1:?usage: scripts/bench-at.sh [--engine] REV}")
[ -d gpu-bundle ] || { echo "no gpu-bundle/: run scripts/gpu-bundle.sh first" >&2; exit 1; }
wt=/tmp/dflash-bench-$rev tgt=/tmp/dflash-bench-target
[ -d "$wt" ] || git worktree add -f "$wt" "$rev" > /dev/null
if [ ! -d "$tgt/release" ] && [ -d target/release ]; then mkdir -p "$tgt" && cp -r target/release "$tgt/"; fi
export DFLASH_REQUIRE_KERNELS=1
if [ $engine = 1 ]; then
  (cd "$wt" && CARGO_TARGET_DIR=$tgt cargo build --release -j2 --bin dflash-engine) \
    || { echo "building the engine at $rev failed" >&2; exit 1; }
  cp "$tgt/release/dflash-engine" "gpu-bundle/dflash-engine-$rev" && strip "gpu-bundle/dflash-engine-$rev"
else
  bin=$(cd "$wt" && CARGO_TARGET_DIR=$tgt cargo bench -j2 --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kernels" and m.get("executable"):
        print(m["executable"])')
  [ -n "$bin" ] || { echo "building the bench at $rev failed (run cargo bench --no-run in $wt to see why)" >&2; exit 1; }
  cp "$bin" "gpu-bundle/bench-kernels-$rev" && strip "gpu-bundle/bench-kernels-$rev"
fi
git worktree remove --force "$wt"
du -sh gpu-bundle/*-"$rev"
