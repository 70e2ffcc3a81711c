#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (ncu --import R --page source --csv --print-source sass).

Per kernel: warp instructions executed, stall samples by reason, the opcode mix by executed
count (with each opcode's stall samples), and the hottest instructions by stall samples. An
issue-bound kernel shows a large integer/branch share beside few HMMA/LDSM; a latency-bound one
concentrates its samples on the instructions after a load or a barrier.

Usage: ncu-sass-summary.py SASS.csv[.gz] [--top N] [--dump DIR]   (--dump writes one
<kernel>.txt per kernel: index, executed, samples, instruction)
"""
import argparse
import collections
import csv
import gzip
import os


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    kernels, hdr, name = {}, None, None
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, hdr = row[1], None
                kernels[name] = []
            elif row[0] == "Address":
                hdr = row
            elif hdr and name:
                kernels[name].append(dict(zip(hdr, row)))
    return kernels


def num(x, key):
    try:
        return int(x.get(key) or 0)
    except ValueError:
        return 0


def opcode(src):
    parts = src.strip().split()
    if not parts:
        return "?"
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dump", help="write one <kernel>.txt listing per kernel into this folder")
    a = ap.parse_args()
    EX, SA = "Instructions Executed", "Warp Stall Sampling (All Samples)"
    for name, rows in read(a.csv).items():
        ex = sum(num(x, EX) for x in rows)
        sa = sum(num(x, SA) for x in rows)
        reasons = collections.Counter()
        for x in rows:
            for k in x:
                if k.startswith("stall_") and "Not Issued" not in k:
                    reasons[k[6:]] += num(x, k)
        ops_ex, ops_sa = collections.Counter(), collections.Counter()
        for x in rows:
            o = opcode(x["Source"])
            ops_ex[o] += num(x, EX)
            ops_sa[o] += num(x, SA)
        print(f"== {name}: {ex:,} warp instructions executed, {sa:,} stall samples, {len(rows)} SASS lines")
        tot = max(1, sum(reasons.values()))
        print("   stalls: " + ", ".join(f"{r} {n / tot:.0%}" for r, n in reasons.most_common(8)))
        print("   opcodes (share of executed, share of samples): " + ", ".join(
            f"{o} {n / max(1, ex):.0%}/{ops_sa[o] / max(1, sa):.0%}" for o, n in ops_ex.most_common(14)))
        print("   hottest instructions (index, executed, samples):")
        hot = sorted(enumerate(rows), key=lambda t: -num(t[1], SA))[: a.top]
        for i, x in hot:
            print(f"   {i:6d} {num(x, EX):12,d} {num(x, SA):7d}  {x['Source'].strip()[:80]}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, name + ".txt"), "w") as f:
                for i, x in enumerate(rows):
                    f.write(f"{i:6d} {num(x, EX):12d} {num(x, SA):7d}  {x['Source'].strip()}\n")


if __name__ == "__main__":
    main()
