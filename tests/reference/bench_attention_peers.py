#!/usr/bin/env python3
"""Times the peers of the engine's attention kernels on the shapes of benches/kernels.rs, on the
same GPU, so the kernel bench can print each engine row's ratio to its peer.

Peers:
  causal128  PyTorch SDPA, cuDNN backend (and the flash backend as causal128_flash), 4 x 3072
             tokens, 32 query / 8 KV heads, head_dim 128, causal per sequence.
  causal256  the same at 1 x 4096, 24 / 4 heads, head_dim 256 (the Qwen3.6 full-attention layer).
  draft_fwd  FlexAttention under the DFlash block mask (DFLASH.md section 3): 4 sequences of 3072
  draft_bwd  context rows, 512 anchors per sequence at 6j, blocks of 16; the query in block j sees
             its sequence's context keys t < a_j and the 16 keys of its own block.
  draft_fwd_sliding / draft_bwd_sliding: the sliding-window layer (W 2048, causal in the block).

Writes one JSON object {key: milliseconds} to --out (and prints a table). A peer that cannot run
here (a backend missing from this torch build) is left out and reported on stderr.
Usage: python3 tests/reference/bench_attention_peers.py --out peers.json [--reps 20]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F


# Timed calls per peer and warm-ups before them (--reps; a profiler such as ncu wants few).
REPS, WARMUP = 20, 5


def median_ms(fn):
    reps, warmup = REPS, WARMUP
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def causal(results, key, batch, seq, heads, kv_heads, hd):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, kv_heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    # Not every backend takes grouped K/V: expanded K/V are what they read then (the expansion is
    # done once, outside the timed call).
    ke = k.repeat_interleave(heads // kv_heads, dim=1)
    ve = v.repeat_interleave(heads // kv_heads, dim=1)
    for name, backend in [("", SDPBackend.CUDNN_ATTENTION), ("_flash", SDPBackend.FLASH_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                ms = median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
            results[key + name] = ms
        except Exception as e:  # a backend this build or GPU lacks
            print(f"peer {key + name}: not available ({str(e).splitlines()[0][:120]})", file=sys.stderr)


def drafter(results, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqs, seq, anchors, bs, heads, kv_heads, hd = 4, 3072, 512, 16, 32, 8, 128
    ctx = seqs * seq
    nb = seqs * anchors
    nq = nb * bs
    anchor = torch.tensor([6 * j for _ in range(seqs) for j in range(anchors)], device="cuda", dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // bs
        r = q_idx % bs
        a = anchor[blk]
        seq_start = (blk // anchors) * seq
        t = kv_idx - seq_start
        in_ctx = kv_idx < ctx
        ctx_ok = in_ctx & (kv_idx >= seq_start) & (t < a)
        kb = (kv_idx - ctx) // bs
        ks = (kv_idx - ctx) % bs
        blk_ok = (~in_ctx) & (kb == blk)
        if window:
            ctx_ok = ctx_ok & (t >= a + r - (window - 1))
            blk_ok = blk_ok & (ks <= r)
        return ctx_ok | blk_ok

    mask = create_block_mask(mask_mod, None, None, nq, ctx + nq, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, heads, nq, hd, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, ctx + nq, hd, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, ctx + nq, hd, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dout = torch.randn(1, heads, nq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    flex = torch.compile(flex_attention)
    suffix = "_sliding" if window else ""
    with torch.no_grad():
        results["draft_fwd" + suffix] = median_ms(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
    # The backward alone: each sample runs a fresh forward (untimed; compiled backward graphs do
    # not allow retaining the graph), then times the backward.
    times = []
    for i in range(WARMUP + REPS):
        out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.grad(out, (q, k, v), dout)
        b.record()
        b.synchronize()
        if i >= WARMUP:
            times.append(a.elapsed_time(b))
    times.sort()
    results["draft_bwd" + suffix] = times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=20, help="timed calls per peer (1 under a profiler: 2 warm-ups then)")
    args = p.parse_args()
    global REPS, WARMUP
    REPS, WARMUP = max(args.reps, 1), (5 if args.reps >= 5 else 2)
    results = {}
    causal(results, "causal128", 4, 3072, 32, 8, 128)
    causal(results, "causal256", 1, 4096, 24, 4, 256)
    for window in (0, 2048):
        try:
            drafter(results, window)
        except Exception as e:
            print(f"peer drafter (window {window}): failed ({str(e).splitlines()[0][:160]})", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"peers on {torch.cuda.get_device_name()} (torch {torch.__version__}):")
    for k, v in results.items():
        print(f"  {k:<22} {v:8.3f} ms")


if __name__ == "__main__":
    main()
