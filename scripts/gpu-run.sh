#!/usr/bin/env bash
# The GPU machine's side of scripts/gpu-bundle.sh: runs what needs the GPU, logs under $OUT.
# Usage (from the repository root): bash gpu-bundle/run.sh [all|tests|sanitize|bench|run8b|pipe8b|pipe8b2|decode8b]...
# Env: T8B (the 8B-shaped target: a folder, or qwen3-8b-shape to generate it in memory), STEPS8B,
# DFLASH_BENCH_ROWS (pipe8b*: which rows, see src/bench.rs), TESTS (a test-name filter).
# tests: with fewer than two GPUs (nvidia-smi -L) the two-GPU tests (names containing two_gpu) are
# skipped and the count printed.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
B=gpu-bundle
export DFLASH_REPO_ROOT=$PWD DFLASH_BIN=$PWD/gpu-bundle/dflash-engine
what=${*:-all}
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"

if has tests; then
  echo "== GPU tests (every test, ignored ones included)"
  # Tests whose name contains two_gpu need a second device; with fewer they would fail with
  # "invalid device ordinal", so a one-GPU machine leaves them out by name and says so.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  skip=""
  if [ "$gpus" -lt 2 ]; then
    n=$($B/integration --include-ignored --list ${TESTS:-} 2>/dev/null | grep ': test$' | grep -c two_gpu)
    skip="--skip two_gpu"
    echo "skipped $n two-GPU tests: this machine has $gpus GPU$([ "$gpus" -eq 1 ] || echo s)" | tee "$OUT/tests.log"
  else
    echo "two-GPU tests included: this machine has $gpus GPUs" | tee "$OUT/tests.log"
  fi
  $B/integration --include-ignored --test-threads=1 --nocapture ${TESTS:-} $skip >> "$OUT/tests.log" 2>&1 || status=1
  grep -E "^test |test result|max rel err|bit-identical|cuda vs cpu|drafter loss|panicked" "$OUT/tests.log" | tail -150
fi
if has sanitize; then
  echo "== compute-sanitizer (scripts/sanitize.sh)"
  OUT=$OUT bash $B/sanitize.sh $B || status=1
fi
if has bench; then
  echo "== kernel bench"
  $B/bench-kernels 2>&1 | tee "$OUT/bench.log" || status=1
fi
W=/tmp/q8b
# T8B=qwen3-8b-shape generates the random target in memory at start-up instead of writing 16 GB.
T8B=${T8B:-$W}
make8b() {
  [ "$T8B" != "$W" ] || [ -f $W/config.json ] || $B/dflash-engine init-model --preset qwen3-8b-shape --seed 0 --init-std 0.02 --out $W 2>&1 | tail -1
  [ -f /tmp/q8b-data.jsonl ] || python3 -c '
import json, random
r = random.Random(0)
with open("/tmp/q8b-data.jsonl", "w") as f:
    for _ in range(64):
        ids = [r.randrange(151000) for _ in range(3072)]
        f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 256 + [1] * (3072 - 256)}) + "\n")'
}
Q8B="--target $T8B --init-std 0.02 --data /tmp/q8b-data.jsonl --batch-size 4 --seq-len 3072 --anchors 512 --block-size 16 --drafter-layers 5 --lr 6e-4"
if has run8b; then
  echo "== Qwen3-8B-shaped run (random weights, random-token data)"
  make8b
  # No checkpoint: the final one alone is ~14 GB of masters and moments at this shape.
  $B/dflash-engine run --device cuda $Q8B --steps ${STEPS8B:-6} --log-every 1 --no-checkpoint --out /tmp/q8b-run \
    2>&1 | tee "$OUT/run8b.log" || status=1
fi
if has pipe8b; then
  echo "== pipeline bench at the Qwen3-8B shape, one GPU"
  make8b
  $B/dflash-engine bench-pipeline --device cuda $Q8B --steps ${STEPS8B:-6} --out /tmp/q8b-bench 2>&1 | tee "$OUT/pipe8b.log" || status=1
fi
if has pipe8b2; then
  echo "== pipeline bench at the Qwen3-8B shape, one and two GPUs"
  make8b
  $B/dflash-engine bench-pipeline --device cuda $Q8B --steps ${STEPS8B:-6} --drafter-gpus 1 --out /tmp/q8b-bench2 2>&1 | tee "$OUT/pipe8b2.log" || status=1
fi
if has decode8b; then
  echo "== decode throughput at the Qwen3-8B shape, batch 64 (prepare-data --regenerate's loop) vs the weight-read bound"
  # The random 8B-shaped target is generated in memory (no 16 GB write); 256 context positions, 32 timed steps.
  $B/dflash-engine bench-decode --device cuda --target ${T8B:-qwen3-8b-shape} --init-std 0.02 --batch 64 \
    --context ${CONTEXT8B:-256} --steps 32 2>&1 | tee "$OUT/decode8b.log" || status=1
fi
if has tiny; then
  echo "== the default run on CUDA (tiny preset)"
  $B/dflash-engine run --device cuda --out /tmp/tiny-run 2>&1 | tail -25 | tee "$OUT/tiny.log" || status=1
fi
exit $status
