#!/usr/bin/env python3
"""Reference timings for benches/kernels.rs's Qwen3.6-27B rows (QWEN35.md sections 4 and 6).

    python3 tests/reference/bench_fla_gdn.py [--reps 20] [--peers peers.json]

- flash-linear-attention's `chunk_gated_delta_rule` (fla-core / flash-linear-attention 0.6, if
  importable; a note otherwise) at the 27B Gated DeltaNet shape: 48 value heads over 16 key
  heads, dk = dv = 128, packed batches 4 x 3072 (cu_seqlens) and 1 x 4096 tokens. q, k bf16,
  already L2-normalised (use_qk_l2norm_in_kernel=False), scale dk^-0.5; g f32 (log decay); beta
  bf16. If this fla version does not take fewer key heads than value heads, q and k are repeated
  to 48 heads first (as transformers' torch path does), outside the timed region, and the row says so.
- PyTorch SDPA (`scaled_dot_product_attention`, is_causal, GQA) at the 27B full-attention shape:
  1 x 4096 tokens, 24 query / 4 kv heads, head_dim 256, bf16.

Each row: median milliseconds of --reps timed calls (CUDA events) after 3 warm-ups, and the
throughput in the same FLOP count the engine's bench prints (the chunk form's products for the
delta rule; 4 * hd * heads * L(L+1)/2 for causal attention), so the rows compare side by side.
With --peers, the fla milliseconds are also merged into that JSON file (created if missing) as
gdn_fla_4x3072 and gdn_fla_1x4096: benches/kernels.rs reads it from $DFLASH_PEERS and prints each
`gdn chunked` row's ratio to fla's time at its shape. fla's time moves from process to process
(on the H200: 1.17 to 1.36 ms at 4 x 3072 in two processes of one call), so the GPU scripts run this
script twice with --keep-best: the ratio is taken against fla's better run.
Exit status 0 even when fla is missing (the SDPA rows still print); non-zero without CUDA.
"""

import argparse
import json
import os
import sys

sys.dont_write_bytecode = True

import torch

HK, HV, DK, DV, CHUNK = 16, 48, 128, 128, 64


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def gdn_flops(lens):
    """The chunk form's products per chunk of L tokens and value head (kernels/gdn.cu's header)."""
    f = 0.0
    for n in lens:
        left = n
        while left > 0:
            l = min(CHUNK, left)
            f += 2.0 * (l * l / 2.0 * (2 * DK + DK + DV + DV) + 3.0 * l * DK * DV)
            left -= l
    return f * HV


def row(name, ms, flops):
    print(f"{name:<52} {ms:>9.3f}ms {flops / (ms * 1e-3) / 1e12:>8.1f} TFLOP/s")


def bench_fla(reps, peers):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means: no fla here
        print(f"flash-linear-attention not importable ({type(e).__name__}: {e}); no fla rows")
        return
    dev = "cuda"
    for lens in ([3072] * 4, [4096]):
        n = sum(lens)
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.nn.functional.normalize(torch.randn(1, n, HK, DK, device=dev, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(1, n, HK, DK, device=dev, generator=gen), dim=-1)
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        v = torch.randn(1, n, HV, DV, device=dev, generator=gen).to(torch.bfloat16)
        g = torch.full((1, n, HV), -0.1, device=dev, dtype=torch.float32)
        beta = torch.full((1, n, HV), 0.5, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], device=dev, dtype=torch.long)
        note = ""

        def call(qq, kk):
            return chunk_gated_delta_rule(
                qq, kk, v, g, beta, scale=DK**-0.5, initial_state=None, output_final_state=False,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
            )

        try:
            call(q, k)
            torch.cuda.synchronize()
            qq, kk = q, k
        except Exception as e:  # noqa: BLE001 - this fla wants as many key heads as value heads
            note = f" [q,k repeated to {HV} heads: {type(e).__name__}]"
            qq, kk = q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)
        ms = median_ms(lambda: call(qq, kk), reps)
        row(f"fla chunk_gated_delta_rule ({len(lens)} x {lens[0]}, 48/16, 128)", ms, gdn_flops(lens))
        peers[f"gdn_fla_{len(lens)}x{lens[0]}"] = ms
        if note:
            print(note)


def bench_sdpa(reps):
    dev = "cuda"
    n, h, kvh, hd = 4096, 24, 4, 256
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, h, n, hd, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, kvh, n, hd, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, kvh, n, hd, device=dev, generator=gen).to(torch.bfloat16)
    f = 4.0 * hd * h * n * (n + 1) / 2.0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = median_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), reps)
    row("torch SDPA causal (1 x 4096, 24/4, 256)", ms, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peers", help="merge the fla times into this JSON file (benches/kernels.rs's DFLASH_PEERS)")
    ap.add_argument(
        "--keep-best",
        action="store_true",
        help="where the file already has an fla time, keep the lower one (run the script more than once this way: "
        "fla's time moves from process to process, and the engine is then compared with its best)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fla_gdn.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    peers = {}
    bench_fla(args.reps, peers)
    if args.peers and peers:
        merge_peers(args.peers, peers, args.keep_best)
    bench_sdpa(args.reps)


def merge_peers(path, peers, keep_best):
    """Writes `peers` into the JSON file at `path`, over what it holds (or the lower time, with keep_best)."""
    merged = {}
    if os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
    for key, ms in peers.items():
        if keep_best and key in merged:
            if merged[key] <= ms:
                print(f"{key}: {ms:.3f} ms this run, keeping the earlier run's {merged[key]:.3f} ms")
            ms = min(ms, merged[key])
        merged[key] = ms
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
