#!/usr/bin/env bash
# The model-scale runs in one device call (under 10 minutes on one H200), after all.sh: the
# 8B-shaped target written once (init-model) while the Gated DeltaNet bench rows run, then the Qwen3.6-27B recipe against the qwen3.6-27b-shape hybrid
# target (run27b), eval and decode throughput at the 8B shape (eval8b, decode8b), and the 8B step's
# phase table (prof8b) last, alone on the GPU. Logs under $OUT. racecheck over the hybrid kernels'
# tests takes a call of its own (run.sh racehybrid: one process per test, ~500 s on an H100), so
# that no instrumented process shares the GPU with the timed runs here.
# Usage, from the repository root on the GPU machine: bash gpu-bundle/models.sh
set -u
B=gpu-bundle
export DFLASH_REPO_ROOT=$PWD DFLASH_BIN=$PWD/gpu-bundle/dflash-engine
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el "8B target to /tmp/q8b (host) | gdn bench rows"
$B/dflash-engine init-model --preset qwen3-8b-shape --seed 0 --init-std 0.02 --out /tmp/q8b > /tmp/init8b.txt 2>&1 &
INIT=$!
DFLASH_BENCH_KERNELS="gdn" timeout 60 $B/bench-kernels > $OUT/gdnbench.log 2>&1; echo "gdn bench rc $?"
sed -n '/^kernel  /,/^$/p' $OUT/gdnbench.log
$B/integration --include-ignored --exact gpu::hybrid::gpu_qwen35_tiny_taps_match_cpu --nocapture > $OUT/tinytaps.log 2>&1
echo "tiny taps rc $?"; grep -E "tap|update|test result" $OUT/tinytaps.log | tail -18
el "run27b"
OUT=$OUT STEPS27B=3 timeout 240 bash $B/run.sh run27b > /dev/null 2>&1; echo "run27b rc $?"
grep -vE "^\s*$" $OUT/run27b.log | tail -24
wait $INIT; tail -1 /tmp/init8b.txt
el "eval8b, decode8b"
OUT=$OUT T8B=/tmp/q8b timeout 150 bash $B/run.sh eval8b > /dev/null 2>&1; echo "eval8b rc $?"; tail -22 $OUT/eval8b.log
OUT=$OUT T8B=/tmp/q8b timeout 100 bash $B/run.sh decode8b > /dev/null 2>&1; echo "decode8b rc $?"; tail -14 $OUT/decode8b.log
el "prof8b"
OUT=$OUT T8B=/tmp/q8b STEPS8B=5 timeout 100 bash $B/run.sh prof8b > /dev/null 2>&1; echo "prof8b rc $?"; grep -vE "^\s*$" $OUT/prof8b.log | tail -24
el done
