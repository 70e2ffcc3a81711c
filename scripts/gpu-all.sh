#!/usr/bin/env bash
# Everything that needs the GPU in one device call (~7 min on the H200 pair): the kernel bench
# alone (the 8B model is written meanwhile), then every GPU test (then the 8B run) in parallel with
# the four compute-sanitizer tools and the stream-order pass, then the 8B pipeline rows. The tests
# go through run.sh, which counts the GPUs: on one GPU the two-GPU tests (names containing
# two_gpu) are skipped with a line saying how many.
# Usage, from the repository root on the GPU machine: bash gpu-bundle/all.sh (summaries under $OUT:
# bench.log, tests.log, pipe8b2.log (pipe8b.log on one GPU), summary.txt; few files, so the device
# tool returns them all).
# Each part has its own timeout so that the whole stays under a 10-minute call.
set -u
B=gpu-bundle
export DFLASH_REPO_ROOT=$PWD DFLASH_BIN=$PWD/gpu-bundle/dflash-engine
L=/tmp/L; mkdir -p $L
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el "kernel bench (the 8B model is written to /tmp/q8b meanwhile, on the host)"
$B/dflash-engine init-model --preset qwen3-8b-shape --seed 0 --init-std 0.02 --out /tmp/q8b > $L/init.txt 2>&1 &
INIT=$!
# The attention peers first (cuDNN SDPA, FlexAttention with the DFlash mask), on the same GPU, so
# the bench table prints each attention row's ratio to its peer.
timeout 150 python3 tests/reference/bench_attention_peers.py --out $OUT/peers.json > $OUT/peers.log 2>&1; echo "peers rc $?"
DFLASH_PEERS=$OUT/peers.json timeout 150 $B/bench-kernels > $OUT/bench.log 2>&1; echo "bench rc $?"
grep "measured peaks\|fc kernel /" $OUT/bench.log; sed -n '/^kernel  /,/^$/p' $OUT/bench.log
wait $INIT; tail -1 $L/init.txt
el "parallel: tests then run8b | 4 sanitizers | stream-order"
# run.sh tests writes $OUT/tests.log; with one GPU it skips the two-GPU tests and says so there.
( OUT=$OUT timeout 260 bash $B/run.sh tests > $L/tests.txt 2>&1; echo "tests rc $?" > $L/tests.rc
  grep -E "two-GPU tests" $OUT/tests.log >> $L/tests.rc
  OUT=$L T8B=/tmp/q8b STEPS8B=4 timeout 85 bash $B/run.sh run8b > /dev/null 2>&1; echo "run8b rc $?" >> $L/tests.rc ) &
( OUT=$L STREAM_TESTS=none timeout 340 bash $B/sanitize.sh $B > $L/san4.txt 2>&1; echo "san4 rc $?" >> $L/san4.txt ) &
( OUT=$L SANITIZERS=" " timeout 340 bash $B/sanitize.sh $B > $L/stream.txt 2>&1; echo "stream rc $?" >> $L/stream.txt ) &
wait
# The two-GPU rows need a second GPU; on one, the synchronous row against the same-GPU hand-off.
if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" -ge 2 ]; then pipe=pipe8b2 rows="sync [0];->"; else pipe=pipe8b rows="sync [0];async same"; fi
el "pipeline rows ($pipe: $rows)"
DFLASH_BENCH_ROWS="$rows" OUT=$L T8B=/tmp/q8b STEPS8B=6 timeout 110 bash $B/run.sh $pipe > /dev/null 2>&1; echo "pipe rc $?"
cp $L/$pipe.log $OUT/ 2>/dev/null
{ cat $L/tests.rc $L/san4.txt $L/stream.txt; for f in $L/sanitize-*.log; do echo "== $f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Hazard|rror" $f | head -20; done; echo "== run8b"; tail -45 $L/run8b.log; } > $OUT/summary.txt
grep -E "^test .*(FAILED|panicked)|panicked at" $OUT/tests.log | head -20; grep "test result" $OUT/tests.log
cat $L/tests.rc $L/san4.txt $L/stream.txt
grep -E "step |peak|loaded|summary|ms/step|GiB" $L/run8b.log | tail -14
tail -16 $L/$pipe.log
el done
