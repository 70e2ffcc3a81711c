#!/usr/bin/env bash
# Packs every file under $OUT, with the sanitizer logs all.sh keeps under /tmp/L, into
# $OUT/logs.tgz and leaves beside it only the files named (default: summary.txt), for a runner
# that brings back a few files of a call: one call's whole test log, bench and sanitizer reports
# come back as one archive instead of the first few files.
# Usage, on the GPU machine after all.sh / run.sh / models.sh: bash gpu-bundle/pack.sh [KEEP...]
set -uo pipefail
OUT=${OUT:-gpu-logs}
keep=${*:-summary.txt}
stage=$(mktemp -d)
mkdir -p "$stage/logs"
cp -r "$OUT"/. "$stage/logs/" 2>/dev/null
if [ -d /tmp/L ]; then
  mkdir -p "$stage/logs/sanitizer"
  find /tmp/L -name 'sanitize-*.log' | while read -r f; do
    # /tmp/L/memcheck-0/sanitize-memcheck.log -> sanitizer/memcheck-0_sanitize-memcheck.log
    cp "$f" "$stage/logs/sanitizer/$(echo "${f#/tmp/L/}" | tr / _)"
  done
fi
tar czf "$stage/logs.tgz" -C "$stage" logs || exit 1
for k in $keep; do [ -f "$OUT/$k" ] && cp "$OUT/$k" "$stage/"; done
rm -rf "${OUT:?}"/*
mv "$stage/logs.tgz" "$OUT/"
for k in $keep; do [ -f "$stage/$k" ] && mv "$stage/$k" "$OUT/"; done
rm -rf "$stage"
ls -l "$OUT"
