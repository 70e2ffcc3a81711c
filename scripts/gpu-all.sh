#!/usr/bin/env bash
# Every GPU test, the sanitizers and the kernel bench in one device call (under 10 minutes on one
# H200): the attention peers and the kernel bench with its Gated DeltaNet rows, the
# flash-linear-attention / SDPA reference beside them, then every GPU test in parallel with
# memcheck, synccheck and the stream-order pass (initcheck and racecheck: a second call, below).
# The tests go through run.sh, which counts the GPUs: on one GPU the two-GPU tests (names
# containing two_gpu) are skipped with a line saying how many; the CPU tests (run by `cargo test`
# everywhere) are left out by the filter `gpu_`. The model-scale runs (prof8b, pipe8b, run27b,
# eval8b, decode8b) are run.sh modes of their own, for a second call.
# Usage, from the repository root on the GPU machine: bash gpu-bundle/all.sh (summaries under $OUT:
# peers.log, bench.log, hybridbench.log, tests.log, summary.txt; few files, so the device tool
# returns them all). Each part has its own timeout so that the whole stays under a 10-minute call.
set -u
B=gpu-bundle
export DFLASH_REPO_ROOT=$PWD DFLASH_BIN=$PWD/gpu-bundle/dflash-engine
L=/tmp/L; rm -rf $L; mkdir -p $L
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# BENCH=0 leaves out the first part (peers and bench); RUN_TESTS=0 the tests and the stream-order
# pass; TOOLS lists the compute-sanitizer tools run beside them (default memcheck synccheck: the
# two that fit; initcheck and racecheck take a call of their own, e.g.
#   BENCH=0 RUN_TESTS=0 TOOLS="initcheck racecheck" SHARDS=4 WINDOW=560 bash gpu-bundle/all.sh);
# WINDOW is the parallel part's limit in seconds; SHARDS=N splits each tool's test modules over N
# processes (sanitize.sh's SHARD), so a slow tool's modules run side by side. Unsharded,
# initcheck and racecheck did not finish in 420 s on the H200. With SHARDS=4 (both tools, eight
# processes) racecheck's shards took 389 s (the one with gpu::attention::), 15, 89 and 9 s, and
# initcheck's shard holding both the attention module and the async-vs-sync suite did not finish
# in 440 s; with the suite moved beside pack and cross-entropy, gemm + attention + optimizer
# finished clean in 44 s but the suite's shard still ran past 350 s. So with SHARDS > 1 the suite
# now has shard 0 to itself (sanitize.sh); initcheck over it may still need a call of its own:
#   OUT=$OUT KERNEL_TESTS=" " SANITIZERS=initcheck STREAM_TESTS=none bash gpu-bundle/sanitize.sh
# synccheck, too, no longer fits beside the tests (on the H200 at d3a31b2: past 400 s unsharded,
# where memcheck took 325 s); alone with SHARDS=4 and WINDOW=420 (at 36b38f2) its shards of norm +
# attention + cross-entropy (66 s) and elementwise + hybrid + optimizer (55 s) finished clean,
# while gemm + pack + hybrid_fused and the suite's shard did not finish.
# On the H100 at 0cd91fe, TOOLS="initcheck synccheck" SHARDS=4 SUITE_SPLIT="same p2p host"
# WINDOW=540 (twelve processes): every kernel shard finished (synccheck 41-121 s, 0 errors;
# initcheck 110-154 s, 0 errors but for gemm + pack + hybrid_fused: 327,680 reports; rerun alone,
# gpu_gemm_matches_cpu gave 81,920, and those printed were cuBLASLt's split-K reduce reading its
# workspace after the 16x1024x8192 GEMM, whose result matched the CPU), while
# each transport's third of the suite still ran past 540 s under both tools, initcheck having
# reported 2-byte reads of uninitialised memory in each (the suite now runs with --mfu-peak off;
# `where` names the kernel next time). racecheck alone
# (SHARDS=4, gpu::hybrid:: included, WINDOW=420): attention + gemm + optimizer 381 s with 4
# hazards, each in one of cuBLASLt's nvjet split-K kernels; norm + hybrid past 420 s (in the chunked
# Gated DeltaNet test); the other two clean. Later on the H100 (SANITIZERS=racecheck, three
# processes of sanitize.sh side by side, 270 s): gpu::norm:: alone 0 hazards in 3 s; the chunked
# Gated DeltaNet test alone and the other gpu::hybrid:: tests together both ran past the window.
# The suite's initcheck reports were placed by run.sh initrun (one run of the suite's shape):
# reads of cuBLASLt-written buffers (README, "Where they stand").
W=${WINDOW:-400}
N=${SHARDS:-1}
if [ "${BENCH:-1}" != 0 ]; then
el "attention peers, kernel bench, Gated DeltaNet reference"
# The attention peers first (cuDNN SDPA, FlexAttention with the DFlash mask), on the same GPU, so
# the bench table prints each attention row's ratio to its peer.
timeout 120 python3 tests/reference/bench_attention_peers.py --out $OUT/peers.json > $OUT/peers.log 2>&1; echo "peers rc $?"
# flash-linear-attention's wheels (scripts/fetch-wheels.sh), on the path of its bench only (the
# transformers oracles must run transformers' own torch code); its times join the peers, so the
# bench table prints each gdn row's ratio to fla.
fla_path=""
if ls $B/whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $B/whl/*.whl; then fla_path=/tmp/site; fi
# Twice, keeping fla's better time (its time moves from process to process; bench_fla_gdn.py says).
for run in 1 2; do
  PYTHONPATH=$fla_path${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 $B/bench_fla_gdn.py --peers $OUT/peers.json --keep-best \
    >> $OUT/hybridbench.log 2>&1; echo "gdn reference run $run rc $?"
done
tail -12 $OUT/hybridbench.log
DFLASH_PEERS=$OUT/peers.json timeout 150 $B/bench-kernels > $OUT/bench.log 2>&1; echo "bench rc $?"
grep "measured peaks\|fc kernel /" $OUT/bench.log; sed -n '/^kernel  /,/^$/p' $OUT/bench.log
fi
el "parallel: $([ "${RUN_TESTS:-1}" != 0 ] && echo "tests | stream-order | ")${TOOLS:-memcheck synccheck}"
if [ "${RUN_TESTS:-1}" != 0 ]; then
  ( OUT=$OUT TESTS=gpu_ timeout $W bash $B/run.sh tests > $L/tests.txt 2>&1; echo "tests rc $?" > $L/tests.rc
    grep -E "two-GPU tests" $OUT/tests.log >> $L/tests.rc ) &
  ( OUT=$L SANITIZERS=" " timeout $W bash $B/sanitize.sh $B > $L/stream.txt 2>&1; echo "stream rc $?" >> $L/stream.txt ) &
fi
# racecheck over the Gated DeltaNet kernels (gpu::hybrid::) takes a call of its own (run.sh
# racehybrid, one process per test): with them it does not fit beside the tests; the fused passes
# (gpu::hybrid_fused::) are quick and run here too.
# RACE_TESTS (env) narrows racecheck further, e.g. to the tests of the kernels a change touched.
# One process per tool: one after the other they need more than the window (memcheck alone ~100 s,
# initcheck longer); side by side they share the 16 host cores, where the instrumentation runs.
# Measured on the H200 with all four tools beside the tests: memcheck 288 s, synccheck 303 s,
# stream order 143 s, the tests 304 s; initcheck and racecheck did not finish in 420 s (hence
# TOOLS' default and the second call above).
# SUITE_SPLIT (with SHARDS > 1) names transports of the async-vs-sync suite, e.g. "same p2p host":
# shard 0, which holds the suite alone, becomes one process per transport
# (DFLASH_NAN_SUITE_TRANSPORT, tests/nan_suite.rs), since under initcheck and synccheck the whole
# suite did not finish in one window. racecheck's shards hold no suite and are not split. Each
# such process runs both one-GPU matrices, the dense target's and the hybrid one's (the filter
# nan_suite::gpu_async_matches_sync_on_one_gpu matches both names); SAN_TESTS="--exact
# nan_suite::gpu_async_matches_sync_on_one_gpu" keeps the dense one alone.
for tool in ${TOOLS:-memcheck synccheck}; do
  for i in $(seq 0 $((N - 1))); do
    shard=""; [ "$N" -gt 1 ] && shard=$i/$N
    parts="-"; [ "$i" -eq 0 ] && [ "$N" -gt 1 ] && [ -n "${SUITE_SPLIT:-}" ] && [ "$tool" != racecheck ] && parts=$SUITE_SPLIT
    for p in $parts; do
      tag=$i; [ "$p" = - ] || tag=$i-$p
      ( export DFLASH_NAN_SUITE_TRANSPORT=${p#-}
        OUT=$L/$tool-$tag SHARD=$shard SANITIZERS=$tool STREAM_TESTS=none RACE_TESTS="${RACE_TESTS:-gpu::gemm:: gpu::norm:: gpu::elementwise:: gpu::pack:: gpu::attention:: gpu::hybrid_fused:: gpu::cross_entropy:: gpu::optimizer::}" \
          timeout $W bash $B/sanitize.sh $B > $L/san-$tool-$tag.txt 2>&1
        echo "$tool${shard:+ shard $shard}${DFLASH_NAN_SUITE_TRANSPORT:+ (suite: $DFLASH_NAN_SUITE_TRANSPORT)} rc $?" >> $L/san-$tool-$tag.txt ) &
    done
  done
done
wait
{ cat $L/tests.rc $L/san-*.txt $L/stream.txt 2>/dev/null; for f in $L/sanitize-*.log $L/*/sanitize-*.log; do [ -f "$f" ] || continue; echo "== $f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Hazard|rror" $f | head -20
  # The first report whole (what, where, which thread, the address), for a finding to be placed.
  grep -m1 -A4 -E "=+ (Uninitialized|Invalid|Error:|Barrier|Program hit)" $f | grep -v "Host Frame"; done; } > $OUT/summary.txt
if [ "${RUN_TESTS:-1}" != 0 ]; then
  grep -E "^test .*(FAILED|panicked)|panicked at" $OUT/tests.log | head -20; grep "test result" $OUT/tests.log
fi
cat $L/tests.rc $L/san-*.txt $L/stream.txt 2>/dev/null
el done
