#!/usr/bin/env bash
# The GPU machine's side of scripts/gpu-bundle.sh: runs what needs the GPU, logs under $OUT.
# Usage (from the repository root): bash gpu-bundle/run.sh [all|tests|sanitize|bench|hybridbench|run8b|prof8b|ab8b|acc8b|pipe8b|pipe8b2|eval8b|decode8b|run27b|run27b2|pipe27b|target27b|target8b|ncu|ncusrc|attn|gdn|gemmk|initrun|racehybrid]...
# Env: T8B (the 8B-shaped target: a folder, or qwen3-8b-shape to generate it in memory), STEPS8B,
# T27B (run27b's target: default the qwen3.6-27b-shape preset generated in memory; any folder with
# hidden 5120, 64 layers and vocabulary 248320 works), STEPS27B; run27b, run27b2, pipe27b and ab8b (see below) run only when
# named (not part of all), and so do ncu (Nsight Compute over the attention and GDN kernels), ncusrc
# (Nsight Compute's full set with per-instruction samples over NCU_KERNELS, a kernel-name regex,
# default the fast GDN kernels, in the bench group NCU_BENCH, default gdn, NCU_COUNT launches) and
# attn (every attention test, the four sanitizers on the forms tests, the bench with peers), gdn
# (what a change to kernels/gdn.cu or hybrid.cu needs: every gpu::hybrid / hybrid_fused test and the
# hybrid training test, the sanitizers on the Gated DeltaNet and conv tests, the 27B-shaped bench
# beside flash-linear-attention), gemmk (what a change to kernels/fc.cu, mlp.cu or tma_gemm.cuh
# needs: their tests, the four sanitizers on them, the fc and mlp bench groups), initrun (initcheck over training runs at the async-vs-sync
# suite's shape, dense and hybrid, each report's kernel printed), racehybrid (racecheck over every
# gpu::hybrid / hybrid_fused test, one process per test: RACE_PAR side by side, RACE_S each,
# RACE_SPLIT's tests as RACE_CASES processes of a share of their cases each, RACE_ONLY a filter),
# DFLASH_BENCH_ROWS (pipe8b*: which rows, see src/bench.rs), TESTS (a test-name filter),
# EXTRA8B / EXTRA27B (more flags for the 8B / 27B runs, e.g. "--recompute projections").
# tests: with fewer than two GPUs (nvidia-smi -L) the two-GPU tests (names containing two_gpu) are
# skipped and the count printed.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
B=gpu-bundle
export DFLASH_REPO_ROOT=$PWD DFLASH_BIN=$PWD/gpu-bundle/dflash-engine
what=${*:-all}
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
# Modes only run when named (not part of all: each takes minutes of a whole H200).
named() { [[ " $what " == *" $1 "* ]]; }
status=0
# san NAME LABEL SECONDS TOOL ARGS...: one compute-sanitizer run of TOOL over ARGS (the tool's own
# options, then the program), given SECONDS. Appends "TOOL LABEL: verdict" to $OUT/NAME-san.txt
# and, on any failure, the log's first 6 KB to $OUT/NAME-san-detail.txt (which instructions, which
# hazard: located without another call). The verdict is the tool's summary line, or says why there
# is none: the time ran out, or the tool itself failed (an "Internal Sanitizer Error").
# SAN_NOT_OURS (a regex of kernel names, e.g. cuBLASLt's): reports that name only such kernels
# (every "at KERNEL+0x..." of the log) do not fail the check when the tests themselves passed; the
# verdict counts them.
san() {
  local name=$1 label=$2 secs=$3 tool=$4 log=/tmp/$1-san.log rc verdict internal kernels theirs
  shift 4
  timeout --foreground "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 "$@" > "$log" 2>&1
  rc=$?
  verdict=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  internal=$(grep -m1 "Internal Sanitizer Error" "$log" | sed 's/^=* *//')
  if [ $rc -eq 9 ] && [ -n "${SAN_NOT_OURS:-}" ] && [ -z "$internal" ] && grep -q "^test result: ok" "$log"; then
    kernels=$(grep -oE " at [A-Za-z_][A-Za-z0-9_]*\+0x" "$log" | sed -E 's/^ at //; s/\+0x$//' | sort -u)
    theirs=$(grep -cE "$SAN_NOT_OURS" <<< "$kernels")
    if [ -n "$kernels" ] && [ "$theirs" -eq "$(wc -l <<< "$kernels")" ]; then
      rc=0
      verdict="0 in ours; the reports name only $(tr '\n' ' ' <<< "$kernels")(matching /$SAN_NOT_OURS/): $verdict"
    fi
  fi
  if [ $rc -eq 124 ]; then
    verdict="timed out after ${secs} s, no summary${verdict:+ ($verdict)}"
  elif [ -n "$internal" ]; then
    verdict="the tool failed: $internal${verdict:+; $verdict}"
  elif [ -z "$verdict" ]; then
    verdict="exit $rc, no summary"
  fi
  if [ $rc -ne 0 ]; then
    status=1
    { echo "== $tool $label (exit $rc)"; head -c 6000 "$log"; } >> "$OUT/$name-san-detail.txt"
  fi
  echo "$tool $label: $verdict" | tee -a "$OUT/$name-san.txt"
}
# flash-linear-attention from the wheels the bundle carries (scripts/fetch-wheels.sh), if any: on
# the path of the fla bench and the transformers target bench only (the transformers oracles run
# transformers' own code).
fla_path=""
if ls $B/whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $B/whl/*.whl; then fla_path=/tmp/site; fi
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
if has hybridbench; then
  echo "== Qwen3.6-27B-shaped kernels: the chunked Gated DeltaNet and head_dim-256 causal attention,"
  echo "   flash-linear-attention's chunk_gated_delta_rule and torch SDPA, then the engine's kernels"
  echo "   (each gdn row with its ratio to fla at its shape)"
  rm -f "$OUT/gdn_peers.json" "$OUT/hybridbench.log"
  # Twice, keeping fla's better time (its time moves from process to process).
  for run in 1 2; do
    PYTHONPATH=$fla_path${PYTHONPATH:+:$PYTHONPATH} python3 $B/bench_fla_gdn.py --peers "$OUT/gdn_peers.json" --keep-best 2>&1 \
      | tee -a "$OUT/hybridbench.log" || status=1
  done
  DFLASH_PEERS="$OUT/gdn_peers.json" DFLASH_BENCH_KERNELS="gdn;attention" $B/bench-kernels 2>&1 | tee -a "$OUT/hybridbench.log" || status=1
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
# --init-std draws a preset's random weights; a folder's own weights need none (the engine refuses
# it there, and a name that is no folder is a preset or refused as unknown).
preset_std() { [ -d "$1" ] || echo "--init-std 0.02"; }
Q8B="--target $T8B $(preset_std $T8B) --data /tmp/q8b-data.jsonl --batch-size 4 --seq-len 3072 --anchors 512 --block-size 16 --drafter-layers 5 --lr 6e-4"
if has run8b; then
  echo "== Qwen3-8B-shaped run (random weights, random-token data)"
  make8b
  # No checkpoint: the final one alone is ~14 GB of masters and moments at this shape.
  $B/dflash-engine run --device cuda $Q8B --steps ${STEPS8B:-6} --log-every 1 --no-checkpoint --out /tmp/q8b-run \
    2>&1 | tee "$OUT/run8b.log" || status=1
fi
if has prof8b; then
  echo "== Qwen3-8B-shaped sync step, profiled by phase (--profile)"
  make8b
  $B/dflash-engine run --device cuda $Q8B ${EXTRA8B:-} --steps ${STEPS8B:-5} --sync --profile --log-every 1 --no-checkpoint --out /tmp/q8b-prof \
    2>&1 | tee "$OUT/prof8b.log" || status=1
fi
# ab8b: prof8b's step with this bundle's engine and with each gpu-bundle/dflash-engine-REV that
# `scripts/bench-at.sh --engine REV` built, in turn, AB8B_ROUNDS rounds (default 2; the second
# runs them in reverse order): the step moves by a few ms from one call to the next with the
# clocks, so a change's effect is measured against its base in one call. $OUT/ab8b.txt: each
# run's step time and device peak; $OUT/ab8b-NAME-ROUND.log: its whole summary and phase table.
if named ab8b; then
  echo "== the 8B sync step: this build against the other engine builds in the bundle, in turn"
  make8b
  engines=($B/dflash-engine $(ls $B/dflash-engine-* 2>/dev/null))
  if [ ${#engines[@]} -lt 2 ]; then
    echo "ab8b: no gpu-bundle/dflash-engine-REV to compare with (scripts/bench-at.sh --engine REV builds one)"
    status=1
  fi
  rm -f "$OUT"/ab8b*
  for round in $(seq 1 ${AB8B_ROUNDS:-2}); do
    order=("${engines[@]}")
    [ $((round % 2)) -eq 1 ] || order=($(printf '%s\n' "${engines[@]}" | tac))
    for e in "${order[@]}"; do
      name=$(basename "$e") log="$OUT/ab8b-$(basename "$e")-$round.log"
      $e run --device cuda $Q8B ${EXTRA8B:-} --steps ${STEPS8B:-5} --sync --profile --log-every 1 --no-checkpoint \
        --out /tmp/q8b-ab > "$log" 2>&1 || status=1
      step=$(grep -m1 '^step time' "$log" | sed 's/^step time *//')
      peak=$(grep -m1 '^device memory' "$log" | sed 's/^device memory *//; s/,.*//')
      echo "$name round $round: ${step:-no step time (see $log)}; ${peak:-no device peak}" | tee -a "$OUT/ab8b.txt"
    done
  done
fi
# The same recipe as two micro-batches of 2 sequences per optimizer step: the same samples per
# step, the drafter's activations halved (device peak 38 GiB against 46 GiB at --batch-size 4, both measured
# before activations were parked: 42 GiB at --batch-size 4 since).
if named acc8b; then
  echo "== Qwen3-8B-shaped sync step, 2 x 2 sequences (--grad-accum 2)"
  make8b
  $B/dflash-engine run --device cuda ${Q8B/--batch-size 4/--batch-size 2} ${EXTRA8B:-} --grad-accum 2 --steps ${STEPS8B:-6} --sync --log-every 1 \
    --no-checkpoint --out /tmp/q8b-acc 2>&1 | tee "$OUT/acc8b.log" || status=1
fi
if has pipe8b; then
  echo "== pipeline bench at the Qwen3-8B shape, one GPU"
  make8b
  $B/dflash-engine bench-pipeline --device cuda $Q8B ${EXTRA8B:-} --steps ${STEPS8B:-8} --out /tmp/q8b-bench 2>&1 | tee "$OUT/pipe8b.log" || status=1
fi
if has pipe8b2; then
  echo "== pipeline bench at the Qwen3-8B shape, one and two GPUs"
  make8b
  $B/dflash-engine bench-pipeline --device cuda $Q8B --steps ${STEPS8B:-6} --drafter-gpus 1 --out /tmp/q8b-bench2 2>&1 | tee "$OUT/pipe8b2.log" || status=1
fi
# The Qwen3.6-27B drafter recipe (4 sliding layers of window 2048 + 1 full, H 5120, 32 x 128 query
# heads, 8 KV heads, MLP 17408): 4 x 3072 tokens, 512 anchors, block 16; a few steps, no checkpoint
# (masters and moments of the 1.7B-parameter drafter alone are ~28 GB). One H200: ~52 GB of target
# weights (layers up to the last tap) + ~31 GB of drafter state + activations; the summary prints
# tokens/s, the target's and the drafter's share of the step and the device's peak memory (H200:
# 1,790 ms a step, 94.50 GiB device peak). On an 80 GB card: EXTRA27B="--offload-optimizer --sync"
# (the drafter's AdamW moments in host memory; H100: 1,786 ms a step, 76.75 GiB device peak; the
# async mode runs out of memory there, with four parked layers too).
T27B=${T27B:-qwen3.6-27b-shape}
make27b_data() {
  [ -f /tmp/q27b-data.jsonl ] || python3 -c '
import json, random
r = random.Random(0)
with open("/tmp/q27b-data.jsonl", "w") as f:
    for _ in range(64):
        ids = [r.randrange(248000) for _ in range(3072)]
        f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 256 + [1] * (3072 - 256)}) + "\n")'
}
Q27B="--target $T27B $(preset_std $T27B) --data /tmp/q27b-data.jsonl --drafter-config qwen3.6-27b --batch-size 4 --seq-len 3072 --anchors 512 --lr 6e-4"
if named run27b; then
  echo "== Qwen3.6-27B drafter recipe (target $T27B, random weights, random-token data), one GPU"
  make27b_data
  $B/dflash-engine run --device cuda $Q27B ${EXTRA27B:-} --steps ${STEPS27B:-4} --log-every 1 --no-checkpoint --no-tensorboard \
    --out /tmp/q27b-run 2>&1 | tee "$OUT/run27b.log" || status=1
fi
# bench-pipeline at the 27B recipe: DFLASH_BENCH_ROWS picks the rows (on an 80 GB card only the
# synchronous ones fit: "sync [0];sync serial update" with EXTRA27B="--offload-optimizer", the
# update's PCIe trip beside the next target forward against the same update after the step).
if named pipe27b; then
  echo "== pipeline bench at the Qwen3.6-27B recipe, one GPU"
  make27b_data
  $B/dflash-engine bench-pipeline --device cuda $Q27B ${EXTRA27B:-} --steps ${STEPS27B:-6} --out /tmp/q27b-bench 2>&1 \
    | tee "$OUT/pipe27b.log" || status=1
fi
if named run27b2; then
  echo "== Qwen3.6-27B drafter recipe, target on GPU 0, drafter on GPU 1"
  if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" -lt 2 ]; then
    echo "run27b2 skipped: it needs two GPUs" | tee "$OUT/run27b2.log"
  else
  make27b_data
  $B/dflash-engine run --device cuda $Q27B --drafter-gpus 1 --steps ${STEPS27B:-4} --log-every 1 --no-checkpoint \
    --no-tensorboard --out /tmp/q27b-run2 2>&1 | tee "$OUT/run27b2.log" || status=1
  fi
fi
if has eval8b; then
  echo "== speculative decoding at the Qwen3-8B shape (random target and drafter: the cost of a round, not acceptance)"
  # The in-memory preset unless T8B names a folder that exists (no 16 GB written for this).
  t=qwen3-8b-shape
  [ -f "$T8B/config.json" ] && t=$T8B
  # --foreground: the timeout stays in this script's process group, so a caller's window that
  # ends this script (models.sh) ends the run too (a timeout of its own group would outlive it).
  timeout --foreground 240 $B/dflash-engine eval --device cuda --target $t $(preset_std $t) --drafter random --drafter-layers 5 \
    --prompts generated --num-prompts 4 --max-new-tokens 128 --out "$OUT/eval8b.json" 2>&1 | tee "$OUT/eval8b.log" || status=1
fi
if has decode8b; then
  echo "== decode throughput at the Qwen3-8B shape, batch 64 (prepare-data --regenerate's loop) vs the weight-read bound"
  # The random 8B-shaped target is generated in memory (no 16 GB write) unless T8B names a folder
  # that exists; 256 context positions, 32 timed steps.
  t=qwen3-8b-shape
  [ -f "$T8B/config.json" ] && t=$T8B
  $B/dflash-engine bench-decode --device cuda --target $t $(preset_std $t) --batch 64 \
    --context ${CONTEXT8B:-256} --steps 32 --profile 2>&1 | tee "$OUT/decode8b.log" || status=1
  echo "== the same at batch 1 (eval's target-alone decoding)"
  $B/dflash-engine bench-decode --device cuda --target $t $(preset_std $t) --batch 1 \
    --context ${CONTEXT8B:-256} --steps 32 --profile 2>&1 | tee "$OUT/decode8b1.log" || status=1
fi
if named target27b; then
  echo "== the target's forward with taps at the qwen3.6-27b-shape, 4 x 3072 tokens, layers 0..61 (training's first stage)"
  $B/dflash-engine bench-target --device cuda --target $T27B $(preset_std $T27B) --batch 4 --seq-len 3072 --steps 3 \
    --profile 2>&1 | tee "$OUT/target27b.log" || status=1
  echo "== its peer: transformers (+ flash-linear-attention) at the same shape, 64 layers and cut after layer 61"
  PYTHONPATH=$fla_path${PYTHONPATH:+:$PYTHONPATH} python3 tests/reference/bench_target_hf.py --batch 4 --seq-len 3072 \
    --layers 64,62 --steps 3 --json "$OUT/target27b_hf.json" 2>&1 | tee "$OUT/target27b_hf.log" || status=1
fi
if named target8b; then
  echo "== the target's forward with taps at the Qwen3-8B shape, 4 x 3072 tokens, layers 0..31"
  $B/dflash-engine bench-target --device cuda --target qwen3-8b-shape --init-std 0.02 --batch 4 --seq-len 3072 \
    --steps 5 --profile 2>&1 | tee "$OUT/target8b.log" || status=1
fi
if named attn; then
  echo "== attention: every gpu::attention test, the four compute-sanitizer tools on the forms tests, the bench with peers"
  # What a change to kernels/attention_wgmma.cu needs before it merges: each form against the CPU
  # (and the head_dim-256 hybrid case), racecheck / synccheck / memcheck / initcheck on the tests
  # that run every form, and the attention rows beside cuDNN and FlexAttention in the same call.
  $B/integration --include-ignored --test-threads=1 --nocapture gpu::attention:: gpu_attn_causal_hd256 \
    > "$OUT/attn-tests.log" 2>&1 || status=1
  grep -E "test result|panicked" "$OUT/attn-tests.log" | tail -5
  for t in gpu_causal_attention_warp_specialized_matches_cpu_and_wgmma gpu_drafter_forward_forms_match_cpu \
    gpu_drafter_backward_forms_match_cpu; do
    for tool in racecheck synccheck memcheck initcheck; do
      san attn "$t" 1200 $tool $B/integration --include-ignored --exact gpu::attention::$t --test-threads=1
    done
  done
  python3 tests/reference/bench_attention_peers.py --out "$OUT/peers.json" > /dev/null 2>&1 || status=1
  DFLASH_PEERS="$OUT/peers.json" DFLASH_BENCH_KERNELS=attention $B/bench-kernels 2>&1 | tee "$OUT/attn-bench.log" \
    | grep -E "causal|drafter|peers" || status=1
fi
if named ncu; then
  echo "== Nsight Compute over the attention and Gated DeltaNet kernels and their peers' kernels"
  # Hardware counters per kernel (clocks left alone, as measuring here requires), summarised per
  # kernel name: the engine's warp-specialised causal forward and drafter wgmma kernels and the
  # fast Gated DeltaNet kernels (the bench with one timed run per row), cuDNN's SDPA and
  # FlexAttention's kernels, flash-linear-attention's chunk_gated_delta_rule kernels.
  NCU="ncu --clock-control none --print-summary per-kernel --section SpeedOfLight --section MemoryWorkloadAnalysis
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
  DFLASH_BENCH_REPS=1 DFLASH_BENCH_KERNELS="attention;gdn" $NCU \
    -k regex:'^(attn_causal_fwd_ws|attn_draft_.*_wg|gdn_fast_)' $B/bench-kernels > "$OUT/ncu-engine.txt" 2>&1 || status=1
  $NCU -k regex:'cudnn|triton_tem' python3 tests/reference/bench_attention_peers.py --reps 1 --out /tmp/ncu-peers.json \
    > "$OUT/ncu-peers.txt" 2>&1 || status=1
  PYTHONPATH=$fla_path${PYTHONPATH:+:$PYTHONPATH} $NCU -k regex:'chunk|solve_tril|recompute|cumsum' \
    python3 $B/bench_fla_gdn.py --reps 1 > "$OUT/ncu-fla.txt" 2>&1 || status=1
  tail -3 "$OUT"/ncu-*.txt
fi
if named gemmk; then
  echo "== the TMA GEMM kernels (fc.cu, mlp.cu): their tests, the four sanitizers on them, the bench in sustained rounds"
  # What a change to kernels/fc.cu, mlp.cu or tma_gemm.cuh needs before it merges. The tests run
  # cuBLASLt as their reference, whose own kernels draw reports (initcheck in its split-K reduce,
  # racecheck in nvjet kernels, both on an H100), so memcheck, synccheck and initcheck check only
  # the kernels under test (--kernel-name, a name substring) and racecheck counts cuBLASLt's
  # reports apart (below); any other report fails the mode. GEMMK_S: seconds a tool run may take
  # (fc's racecheck took 112 s on an H200). DFLASH_SANITIZE=1: the tests' smaller shapes, as
  # scripts/sanitize.sh runs them.
  rm -f "$OUT"/gemmk-*
  $B/integration --include-ignored --test-threads=1 --nocapture gpu::gemm::gpu_fc_kernel gpu::gemm::gpu_mlp \
    > "$OUT/gemmk-tests.log" 2>&1 || status=1
  grep -E "test result|panicked|bit for bit" "$OUT/gemmk-tests.log" | tail -8
  for tk in gpu_fc_kernel_matches_cpu:fc_ gpu_mlp_fused_kernel_matches_cpu:mlp_swiglu; do
    t=${tk%%:*} k=${tk#*:}
    for tool in memcheck synccheck initcheck; do
      DFLASH_SANITIZE=1 san gemmk "$t (kernels named *$k*)" ${GEMMK_S:-240} $tool --kernel-name kns=$k \
        $B/integration --include-ignored --exact gpu::gemm::$t --test-threads=1
    done
    # racecheck over every kernel: with a kernel filter, cuBLASLt's uninstrumented GEMM after an
    # instrumented mlp kernel failed inside the tool on an H200 ("Internal Sanitizer Error", then
    # CUBLAS_STATUS_EXECUTION_FAILED; unfiltered the same test ran clean). Its reports in cuBLASLt's
    # own kernels (the tests' reference; two on an H100) are counted, not failed.
    DFLASH_SANITIZE=1 SAN_NOT_OURS='^(nvjet|sm[0-9]+_xmma|cutlass|cublas)' san gemmk "$t (every kernel)" ${GEMMK_S:-240} racecheck \
      $B/integration --include-ignored --exact gpu::gemm::$t --test-threads=1
  done
  DFLASH_BENCH_KERNELS="fc;mlp" $B/bench-kernels 2>&1 | tee "$OUT/gemmk-bench.log" | grep -E "peaks|fc |MLP|mlp kernel" || status=1
fi
if named gdn; then
  echo "== Gated DeltaNet and hybrid kernels: tests, sanitizers, the 27B-shaped rows beside fla"
  $B/integration --include-ignored --test-threads=1 gpu::hybrid:: gpu::hybrid_fused:: gpu::training::gpu_hybrid \
    > "$OUT/gdn-tests.log" 2>&1 || status=1
  grep -E "test result|panicked|FAILED" "$OUT/gdn-tests.log" | tail -5
  # racecheck instruments every shared-memory access: over the GDN tests that run every form it
  # takes more than 400 s, so it covers the fast form's test alone (every fast kernel, dk = 128);
  # the other tools take the GDN and conv tests whole.
  gt="gpu::hybrid::gpu_gdn_chunked gpu::hybrid::gpu_gdn_recurrent gpu::hybrid::gpu_gdn_state gpu::hybrid::gpu_gdn_fast gpu::hybrid::gpu_gdn_split"
  gt="$gt gpu::hybrid::gpu_gdn_fused gpu::hybrid_fused::gpu_fused_gdn_conv"
  for tool in racecheck memcheck initcheck synccheck; do
    tests=$gt; [ $tool = racecheck ] && tests="gpu::hybrid::gpu_gdn_fast gpu::hybrid::gpu_gdn_fused"
    san gdn "(the GDN tests)" 300 $tool $B/integration --include-ignored --test-threads=1 $tests
  done
  rm -f "$OUT/gdn_peers.json" "$OUT/gdn-fla.log"
  for run in 1 2; do  # fla's better time of two processes
    PYTHONPATH=$fla_path${PYTHONPATH:+:$PYTHONPATH} python3 $B/bench_fla_gdn.py --peers "$OUT/gdn_peers.json" --keep-best \
      >> "$OUT/gdn-fla.log" 2>&1 || status=1
  done
  grep -E "^fla" "$OUT/gdn-fla.log"
  DFLASH_PEERS="$OUT/gdn_peers.json" DFLASH_BENCH_KERNELS=gdn $B/bench-kernels 2>&1 | tee "$OUT/gdn-bench.log" \
    | grep -E "gdn chunked ChunkedFast|peers" || status=1
fi
if named ncusrc; then
  echo "== Nsight Compute, full set with source counters: ${NCU_KERNELS:=^gdn_fast_} in bench group ${NCU_BENCH:=gdn}"
  # Where a kernel spends its issue slots and stalls, per SASS instruction: the report's source
  # page as CSV (sass.csv.gz), its details page, and scripts/ncu-sass-summary.py's digest
  # (opcode mix, stall reasons, hottest instructions) printed here.
  DFLASH_BENCH_REPS=1 DFLASH_BENCH_KERNELS=$NCU_BENCH ncu --clock-control none --set full --import-source no \
    -k regex:"$NCU_KERNELS" -c ${NCU_COUNT:-3} -o /tmp/ncusrc -f $B/bench-kernels > "$OUT/ncusrc-run.txt" 2>&1 || status=1
  ncu --import /tmp/ncusrc.ncu-rep --page source --csv --print-source sass > /tmp/sass.csv 2>&1 || status=1
  ncu --import /tmp/ncusrc.ncu-rep --page details > "$OUT/ncusrc-details.txt" 2>&1 || status=1
  gzip -c /tmp/sass.csv > "$OUT/sass.csv.gz"
  python3 $B/ncu-sass-summary.py /tmp/sass.csv | tee "$OUT/ncusrc-summary.txt" || status=1
fi
if named initrun; then
  echo "== initcheck over training runs at the async-vs-sync suite's shape (dense and hybrid tiny targets)"
  # The suite under initcheck takes longer than a device call; one run of its shape does not, and
  # its printed reports name the kernel and the thread. Sync and async on the same GPU.
  # The four runs go side by side (the instrumentation runs on the host's cores).
  for tgt in tiny qwen3.5-tiny; do
    for mode in --sync "--transport same"; do
      tag=$tgt-${mode//[- ]/}
      ( timeout --foreground ${INITRUN_S:-200} compute-sanitizer --tool initcheck --print-limit 12 $B/dflash-engine run \
          --device cuda --target $tgt --gen-samples 32 --seq-len 40 --steps 3 --batch-size 3 --grad-accum 2 --anchors 6 \
          --block-size 8 --mfu-peak off --no-checkpoint --quiet $mode --out /tmp/initrun-$tag > "$OUT/initrun-$tag.log" 2>&1
        echo "exit $?" >> "$OUT/initrun-$tag.log" ) &
    done
  done
  wait
  for f in "$OUT"/initrun-*.log; do
    echo "$(basename $f .log): $(tail -1 $f); $(grep -E 'ERROR SUMMARY' $f)"
    bash $B/sanitize.sh --where $f
    grep -m1 -A6 -E "=+ Uninitialized" $f
  done
fi
if named racehybrid; then
  echo "== racecheck over every gpu::hybrid and gpu::hybrid_fused test, one process per test"
  # racecheck instruments every shared-memory access; over gpu::hybrid:: in one process (or its
  # ragged-batch Gated DeltaNet cases in one test) it ran past every window. One process per test,
  # RACE_PAR side by side (the tool's work runs on the host's cores too), each with its own
  # RACE_S limit; the tests in RACE_SPLIT (default: the CUDA-core form's ragged-batch test, past
  # 500 s alone on an H100) run as RACE_CASES processes, each a share of the cases
  # (DFLASH_GDN_CASES=i/N). RACE_ONLY (a pattern) keeps the matching tests only. A test whose
  # tool is stopped is reported as such, never as clean.
  rm -rf /tmp/racehybrid; mkdir -p /tmp/racehybrid
  split=${RACE_SPLIT:-gpu::hybrid::gpu_gdn_chunked_simt_matches_cpu_on_ragged_batches} n=${RACE_CASES:-6}
  $B/integration --include-ignored --list gpu::hybrid:: gpu::hybrid_fused:: 2>/dev/null | sed -n 's/: test$//p' |
    grep -E -- "${RACE_ONLY:-.}" | while read -r t; do
      if [[ " $split " == *" $t "* ]]; then for i in $(seq 0 $((n - 1))); do echo "$t $i/$n"; done; else echo "$t -"; fi
    done > /tmp/racehybrid.jobs
  race_one() {  # TEST SHARD (- for the whole test): one racecheck process, its log named after both
    local log=/tmp/racehybrid/$1; [ "$2" = - ] || log=$log@${2/\//-of-}
    if [ "$2" = - ]; then unset DFLASH_GDN_CASES; else export DFLASH_GDN_CASES=$2; fi
    timeout --foreground ${RACE_S:-500} compute-sanitizer --tool racecheck --error-exitcode 9 \
      $B/integration --include-ignored --exact "$1" > "$log.log" 2>&1
    echo "exit $?" >> "$log.log"
  }
  export -f race_one; export B
  xargs -P ${RACE_PAR:-8} -L 1 bash -c 'race_one "$0" "$1"' < /tmp/racehybrid.jobs
  for f in /tmp/racehybrid/*.log; do
    rc=$(tail -1 "$f")
    case $rc in
      "exit 0") verdict="clean" ;;
      "exit 124" | "exit 137") verdict="STOPPED by its ${RACE_S:-500} s limit (no result)" ;;
      *) verdict="FAILED ($rc)" ;;
    esac
    echo "$(basename "$f" .log): $verdict; $(grep -E 'RACECHECK SUMMARY|test result|gdn ragged cases' "$f" | tr '\n' ' ')"
    bash $B/sanitize.sh --where "$f"
  done > "$OUT/racehybrid.txt"
  cat "$OUT/racehybrid.txt"
  echo "racehybrid: $(grep -c ': clean;' "$OUT/racehybrid.txt") of $(wc -l < /tmp/racehybrid.jobs) processes clean"
  grep -qE ': (STOPPED|FAILED)' "$OUT/racehybrid.txt" && status=1
  tar -C /tmp -czf "$OUT/racehybrid-logs.tgz" racehybrid
fi
if has tiny; then
  echo "== the default run on CUDA (tiny preset)"
  $B/dflash-engine run --device cuda --out /tmp/tiny-run 2>&1 | tail -25 | tee "$OUT/tiny.log" || status=1
fi
exit $status
