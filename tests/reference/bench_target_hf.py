#!/usr/bin/env python3
"""The peer of `dflash-engine bench-target --target qwen3.6-27b-shape`: transformers' Qwen3.5 text
model at the Qwen3.6-27B shape (QWEN35.md section 1), random bf16 weights made on the GPU, one
forward of B x S tokens (no cache, no hidden states kept), timed with CUDA synchronisation.

    python3 bench_target_hf.py [--batch 4] [--seq-len 3072] [--layers 64,62] [--steps 3] [--json OUT]

With flash-linear-attention importable (the GPU bundle's wheels on PYTHONPATH), transformers' Gated
DeltaNet runs fla's chunked kernels; its full attention runs PyTorch SDPA. The script says which.
`--layers 64,62` times the whole 64-layer model, then the same model cut after layer 61 (the
deepest tap of a 5-layer drafter, where the engine's forward stops).
"""

import argparse
import json
import statistics
import sys
import time

sys.dont_write_bytecode = True

import torch  # noqa: E402
import transformers  # noqa: E402


def text_config(layers):
    # Every fourth layer is full attention (full_attention_interval 4), the rest Gated DeltaNet.
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return transformers.Qwen3_5TextConfig(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=types,
        vocab_size=248320,
        rms_norm_eps=1e-6,
        attn_output_gate=True,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
    )


def fla_in_use():
    """Whether transformers can take fla's kernels (it chooses when its Qwen3.5 module is imported:
    fla's chunk_gated_delta_rule when importable, its torch reference otherwise)."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        return "no: fla is not importable (transformers' torch reference)"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # an fla that cannot load its kernels
        return f"no: fla does not import ({type(e).__name__}: {e})"
    return "yes: fla is importable (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)"


def time_forward(model, ids, steps):
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # warm-up: Triton compiles, cuBLAS picks algorithms
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--layers", default="64,62", help="layer counts to time, largest first")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="write {layers: {ms, tokens_per_s}} here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_target_hf: needs a CUDA GPU")
    counts = sorted({int(x) for x in a.layers.split(",")}, reverse=True)
    if not counts or counts[-1] < 1 or counts[0] > 64:
        raise SystemExit(f"bench_target_hf: --layers {a.layers}: counts from 1 to 64")
    print(f"torch {torch.__version__}, transformers {transformers.__version__} on {torch.cuda.get_device_name()}")
    print(f"flash-linear-attention in transformers' Gated DeltaNet: {fla_in_use()}")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16 (f32 would need 108 GB)
    with torch.device("cuda"):
        model = transformers.Qwen3_5TextModel(text_config(counts[0]))
    model.eval()
    torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model     {counts[0]} layers, {params / 1e9:.2f} B parameters (bf16), built in {time.perf_counter() - t0:.1f} s")
    ids = torch.randint(0, 248320, (a.batch, a.seq_len), device="cuda")
    tokens = a.batch * a.seq_len
    out = {}
    for n in counts:
        if n < len(model.layers):
            # The same weights, cut after layer n - 1.
            model.layers = model.layers[:n]
            model.config.num_hidden_layers = n
            model.config.layer_types = model.config.layer_types[:n]
        sec = time_forward(model, ids, a.steps)
        out[n] = {"ms": sec * 1e3, "tokens_per_s": tokens / sec}
        print(
            f"forward   {a.batch} x {a.seq_len} tokens, layers 0..{n - 1}: {sec * 1e3:.1f} ms median of {a.steps} "
            f"({tokens / sec:.0f} tokens/s)"
        )
    print(f"peak      {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
