#!/usr/bin/env bash
# The GPU test suite under compute-sanitizer (DESIGN.md section 5), on the GPU machine:
#   bash scripts/sanitize.sh [BUNDLE_DIR]          (default gpu-bundle; logs under $OUT)
# - memcheck, initcheck, synccheck, racecheck over the kernel tests and the pipeline's
#   async-vs-sync suite (one GPU);
# - memcheck --track-stream-ordered-races all with the allocator in free-async mode (every free
#   becomes cuMemFreeAsync on its owner stream after waiting for the recorded foreign uses), over
#   the async-vs-sync suite and the run tests: a missing record-use shows up as a race.
# Exit status 0 only if every tool reports 0 errors. Env: SANITIZERS (tool list), SAN_TESTS, RACE_TESTS,
# KERNEL_TESTS, STREAM_TESTS (the stream-order pass's tests; none skips it), SHARD=i/N (this
# process takes modules i, i + N, ... of RACE_TESTS for racecheck; for the other tools shard 0
# takes the async-vs-sync suite alone and shards 1 .. N - 1 share KERNEL_TESTS' modules
# round-robin (N = 1: everything): all.sh runs N of them side by side, each with its own OUT).
set -uo pipefail
# Which kernels a log's printed reports are in (the tools print the first 100 in full), most
# first, NVIDIA's library kernels named as such: on the H100, initcheck and racecheck reported
# inside cuBLASLt's split-K kernels (a decoding-sized 16x1024x8192 GEMM), not in ours. Reports on a
# host API call (initcheck: a copy reading memory it counts as unwritten) are counted by the call.
# `bash sanitize.sh --where LOG` prints it for a log of one's own (run.sh initrun).
where() {
  { grep -oE '(^=+ +at |access at )(void )?[^(<+ ]+' "$1" | sed -E 's/.* at (void )?//'
    grep -oE 'on access by [A-Za-z]+ [a-z]+' "$1" | sed -E 's/on access by ([A-Za-z]+) ([a-z]+)/host-API:\1-\2/'; } |
    sort | uniq -c | sort -rn | head -8 |
    while read -r n k; do
      case $k in
        cublasLt::* | nvjet_* | *xmma* | cutlass*) echo "  $n printed in $k (cuBLASLt's kernel, not this engine's)" ;;
        host-API:*) echo "  $n printed at the host API call $(echo "${k#host-API:}" | tr - ' ')" ;;
        *) echo "  $n printed in $k" ;;
      esac
    done
}
if [ "${1:-}" = --where ]; then where "$2"; exit 0; fi
B=${1:-gpu-bundle}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
# The async-vs-sync matrix in its quick form (every transport and split, one pad and depth).
export DFLASH_NAN_SUITE=quick DFLASH_SANITIZE=1
export DFLASH_REPO_ROOT=${DFLASH_REPO_ROOT:-$PWD} DFLASH_BIN=${DFLASH_BIN:-$PWD/$B/dflash-engine}
# Every kernel family's module under tests/gpu/ (not the whole-model training and oracle tests).
KERNEL_TESTS=${KERNEL_TESTS:-"gpu::gemm:: gpu::norm:: gpu::elementwise:: gpu::pack:: gpu::attention:: gpu::hybrid:: gpu::hybrid_fused:: gpu::cross_entropy:: gpu::optimizer::"}
PIPE_TESTS=${SAN_TESTS:-nan_suite::gpu_async_matches_sync_on_one_gpu}
RACE_LIST=${RACE_TESTS:-$KERNEL_TESTS}
if [ -n "${SHARD:-}" ]; then
  si=${SHARD%/*} sn=${SHARD#*/}
  # pick LIST FIRST COUNT: the items of LIST that fall to this shard when dealt round-robin over
  # shards FIRST .. FIRST + COUNT - 1.
  pick() { local i=0 m out=""; for m in $1; do [ $(($2 + i % $3)) -eq "$si" ] && out="$out $m"; i=$((i + 1)); done; echo $out; }
  RACE_LIST=$(pick "$RACE_LIST" 0 "$sn")
  # With two shards or more the async-vs-sync suite has shard 0 to itself and the kernel modules
  # share the others: under initcheck on the H200 the suite beside the attention module did not
  # finish in 440 s, and beside pack and cross-entropy not in 350 s.
  if [ "$sn" -gt 1 ]; then
    if [ "$si" -eq 0 ]; then KERNEL_TESTS=""; else PIPE_TESTS="" KERNEL_TESTS=$(pick "$KERNEL_TESTS" 1 $((sn - 1))); fi
  fi
fi
# Each tool's timeout runs with --foreground: in a process group of its own, the tool and its
# instrumented test binary outlived a caller's window that ended this script (all.sh, models.sh),
# holding the GPU under the timed runs that followed.
sanitized() { timeout --foreground 900 compute-sanitizer "$@"; }
status=0
summary() { grep -E 'ERROR SUMMARY|test result' "$1" | tr '\n' ' '; }
for tool in ${SANITIZERS:-memcheck initcheck synccheck racecheck}; do
  log="$OUT/sanitize-$tool.log"
  # racecheck instruments shared memory per access: the kernel tests are enough there.
  # RACE_TESTS narrows racecheck (the slowest tool) where a call splits it (all.sh / models.sh).
  tests=$RACE_LIST; [ "$tool" = racecheck ] || tests="$KERNEL_TESTS $PIPE_TESTS"
  if [ -z "${tests// /}" ]; then echo "$tool: no tests in shard ${SHARD:-}"; continue; fi
  # initcheck does not see the stores of cuBLASLt's f32-output GEMM. The probe test (an
  # alloc_uninit buffer the GEMM fills, then read by the conv) passes against the CPU, so every
  # value the conv reads was written, yet initcheck reports those reads (on the H200).
  # The forward's buffers that such a GEMM writes are zero-filled first, so only the probe reads
  # one uninitialised; initcheck leaves it out.
  [ "$tool" = initcheck ] && tests="$tests --skip gpu_conv_of_an_f32_gemm_output_in_an_uninit_buffer"
  # The two tests that time the device (the clock monitor under GEMM load, the MFU peak) run
  # nothing but cuBLASLt GEMMs, which gpu_gemm_matches_cpu covers: instrumented, their ~100
  # GEMMs of 4096^3 kept gemm's shard past 420 s under synccheck on the H200.
  tests="$tests --skip gpu_clock_monitor_reads_the_device_under_gemm_load --skip gpu_gemm_peak_is_measured_on_the_device"
  sanitized --tool "$tool" --error-exitcode 9 "$B/integration" --include-ignored \
    --test-threads=1 $tests > "$log" 2>&1
  rc=$?; echo "$tool: exit $rc; $(summary "$log")"
  where "$log"
  [ $rc -eq 0 ] || status=1
done
# STREAM_TESTS=none skips this pass (a device call too short for every pass runs it separately).
[ "${STREAM_TESTS:-}" = none ] && exit $status
log="$OUT/sanitize-stream-order.log"
# With two GPUs, the data-parallel drafter (NCCL all-reduce, two targets) goes through the same check.
two=""; [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" -ge 2 ] && two="nan_suite::gpu_data_parallel_drafter_matches_lockstep_on_two_gpus"
STREAM_TESTS=${STREAM_TESTS:-"$PIPE_TESTS run::async run::split $two"}
# NCCL (data-parallel runs) probes kernel images with cudaFuncGetAttributes and handles the
# "no kernel image" answers itself; those API errors are not ours, so API errors are not reported
# here (every CUDA call of ours is checked, and a failure fails its test).
DFLASH_ALLOC_MODE=free-async sanitized --tool memcheck --track-stream-ordered-races all \
  --report-api-errors no --error-exitcode 9 "$B/integration" --include-ignored --test-threads=1 $STREAM_TESTS > "$log" 2>&1
rc=$?; echo "stream-ordered races (free-async allocator): exit $rc; $(summary "$log")"
where "$log"
[ $rc -eq 0 ] || status=1
exit $status
