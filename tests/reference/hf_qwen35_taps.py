#!/usr/bin/env python3
"""Hugging Face oracle for the taps of a Qwen3.5/3.6 hybrid target (QWEN35.md, DFLASH.md section 1).

    python3 hf_qwen35_taps.py --model DIR --input INPUT.safetensors --layers 1,3,6 \
        --out OUT.safetensors [--device cuda] [--dtypes float32,bfloat16]

DIR is a text-only checkpoint (`Qwen3_5ForCausalLM`, flat config with model_type "qwen3_5_text"),
e.g. `dflash-engine init-model --preset qwen3.5-tiny --out DIR`. It is loaded with
`transformers.Qwen3_5ForCausalLM.from_pretrained(DIR, dtype=...)` once per dtype, and the load
must report no missing and no unexpected keys.

INPUT holds `input_ids` (int32/int64) either as [B, S] (B sequences of S tokens) or as a packed
batch [N] together with `seq_starts` (int32 [B + 1], sequence b is rows seq_starts[b] ..
seq_starts[b + 1]), the engine's layout. Each sequence runs through the model on its own (batch
1, positions 0..len-1, no padding, no cache), so nothing crosses a sequence start: not the
attention, not the convolution, not the Gated DeltaNet state.

OUT gets, for each requested 0-based decoder layer L and dtype D, `tap_{L}_{D}` = the OUTPUT of
decoder layer L (the raw residual stream, before any final norm; HF `hidden_states[L + 1]`) as
float32 [N, H] in packed row order, plus `layers` (int32 [K]) and `seq_starts` (int32 [B + 1]).
The value comes from a forward hook on `model.model.layers[L]` and, except for the last decoder
layer (whose `hidden_states` entry is the final-norm output), must equal `hidden_states[L + 1]`.
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
# The oracle is transformers' own torch code: with flash-linear-attention importable, its Gated
# DeltaNet would run fla's Triton kernels instead (lower-precision internals: its "f32" forward
# is then no f32 reference). Hide any fla on the path (the GPU bundle carries one for the bench).
sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "fla"))]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402

from _stio import load, save  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_model(path, dtype):
    """Qwen3_5ForCausalLM in `dtype`, with the loading report checked: every key of the file is
    used and every parameter of the model comes from the file."""
    cls = getattr(transformers, "Qwen3_5ForCausalLM", None)
    if cls is None:
        raise SystemExit(f"hf_qwen35_taps: transformers {transformers.__version__} has no Qwen3_5ForCausalLM")
    try:
        model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except TypeError:
        model, info = cls.from_pretrained(path, torch_dtype=dtype, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        bad = list(info.get(kind, []) or [])
        if bad:
            raise SystemExit(f"hf_qwen35_taps: {kind} loading {path}: {bad[:20]}{' ...' if len(bad) > 20 else ''}")
    got = next(model.parameters()).dtype
    if got != dtype:
        raise SystemExit(f"hf_qwen35_taps: model loaded as {got}, asked for {dtype}")
    return model


def sequences(tensors, path):
    if "input_ids" not in tensors:
        raise SystemExit(f"hf_qwen35_taps: {path} has no input_ids (has {sorted(tensors)})")
    ids = tensors["input_ids"]
    if ids.dtype not in (torch.int32, torch.int64):
        raise SystemExit(f"hf_qwen35_taps: input_ids must be int32/int64, got {ids.dtype}")
    ids = ids.to(torch.long)
    if ids.dim() == 2:
        b, s = ids.shape
        starts = [i * s for i in range(b + 1)]
        return [ids[i] for i in range(b)], starts
    if ids.dim() != 1 or "seq_starts" not in tensors:
        raise SystemExit("hf_qwen35_taps: give input_ids [B, S], or a packed input_ids [N] with seq_starts [B + 1]")
    starts = [int(x) for x in tensors["seq_starts"].tolist()]
    if starts[0] != 0 or starts[-1] != ids.numel() or any(a >= b for a, b in zip(starts, starts[1:])):
        raise SystemExit(f"hf_qwen35_taps: seq_starts {starts} must rise from 0 to {ids.numel()}")
    return [ids[a:b] for a, b in zip(starts, starts[1:])], starts


def taps_of(model, seqs, ids_list, device):
    """{layer: float32 [N, H]} with the sequences run one at a time and concatenated."""
    layers = model.model.layers
    n_layers = len(layers)
    for lid in ids_list:
        if not 0 <= lid < n_layers:
            raise SystemExit(f"hf_qwen35_taps: layer id {lid} out of range 0..{n_layers - 1}")
    captured = {}

    def make_hook(lid):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[lid] = out.detach().clone()

        return hook

    parts = {lid: [] for lid in ids_list}
    handles = [layers[lid].register_forward_hook(make_hook(lid)) for lid in sorted(set(ids_list))]
    try:
        for seq in seqs:
            captured.clear()
            with torch.no_grad():
                out = model(input_ids=seq[None, :].to(device), output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            if hs is None or len(hs) != n_layers + 1:
                raise SystemExit(f"hf_qwen35_taps: expected {n_layers + 1} hidden states")
            for lid in ids_list:
                tap = captured[lid]
                if lid < n_layers - 1 and not torch.equal(tap, hs[lid + 1]):
                    diff = (tap.float() - hs[lid + 1].float()).abs().max().item()
                    raise SystemExit(f"hf_qwen35_taps: layer {lid}: hook != hidden_states[{lid + 1}] ({diff})")
                parts[lid].append(tap[0].to(torch.float32).cpu())
    finally:
        for h in handles:
            h.remove()
    return {lid: torch.cat(parts[lid], dim=0).contiguous() for lid in ids_list}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="text-only Qwen3.5 checkpoint directory")
    ap.add_argument("--input", required=True, help="safetensors with input_ids (and seq_starts when packed)")
    ap.add_argument("--layers", required=True, help="comma-separated 0-based decoder layer ids")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {sorted(DTYPES)}")
    args = ap.parse_args()

    print(f"hf_qwen35_taps: transformers {transformers.__version__}, torch {torch.__version__}")
    ids_list = [int(s) for s in args.layers.split(",") if s.strip() != ""]
    if not ids_list:
        raise SystemExit("hf_qwen35_taps: --layers is empty")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"hf_qwen35_taps: unknown dtype {d}; use {sorted(DTYPES)}")

    tensors, _ = load(args.input)
    seqs, starts = sequences(tensors, args.input)
    result = {
        "layers": torch.tensor(ids_list, dtype=torch.int32),
        "seq_starts": torch.tensor(starts, dtype=torch.int32),
    }
    for name in dtypes:
        model = load_model(args.model, DTYPES[name])
        model.eval()
        model.to(args.device)
        print(f"hf_qwen35_taps: {type(model).__name__}, {len(model.model.layers)} layers "
              f"({model.config.layer_types}), dtype {name}, device {args.device}, "
              f"{len(seqs)} sequences, {starts[-1]} tokens")
        for lid, tap in taps_of(model, seqs, ids_list, args.device).items():
            result[f"tap_{lid}_{name}"] = tap
            print(f"hf_qwen35_taps: tap_{lid}_{name}: {list(tap.shape)} mean|x| {tap.abs().mean().item():.6g} "
                  f"max|x| {tap.abs().max().item():.6g}")
        del model

    save(result, args.out)
    print(f"hf_qwen35_taps: wrote {len(ids_list) * len(dtypes)} taps to {args.out}")


if __name__ == "__main__":
    main()
