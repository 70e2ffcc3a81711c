#!/usr/bin/env python3
"""Hugging Face oracle for the target taps (DFLASH.md section 1).

    python3 hf_taps.py --model DIR --input INPUT.safetensors --layers 1,3 --out OUT.safetensors \
        [--device cuda] [--dtype bfloat16]

INPUT holds `input_ids` (int32 or int64, [B, S]). The model is loaded with
`transformers.AutoModelForCausalLM.from_pretrained(DIR, dtype=...)` and run once on all rows with
`output_hidden_states=True` (default causal attention, positions 0..S-1, no padding).
OUT gets, for each requested 0-based decoder layer L, `tap_{L}` = the OUTPUT of decoder layer L
(= HF `hidden_states[L + 1]`) as float32 [B, S, H], plus `layers` (int32 [K], the ids in the
order given).

The tap is captured with a forward hook on `model.model.layers[L]` (the raw residual stream, before
any final norm) and cross-checked against `hidden_states[L + 1]`, which must be bit-identical.
For the LAST decoder layer, HF's `hidden_states[-1]` is the final-norm output, not the raw layer
output, so there the hook value is written (DFLASH.md: taps are taken before any final norm) and
a note is printed.
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402

from _stio import load, save  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_model(path, dtype):
    """`dtype=` is the keyword of current transformers; older versions spell it `torch_dtype=`."""
    model = None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:
        model = None
    if model is None or next(model.parameters()).dtype != dtype:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    got = next(model.parameters()).dtype
    if got != dtype:
        raise SystemExit(f"hf_taps: model loaded as {got}, asked for {dtype}")
    return model


def decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise SystemExit(f"hf_taps: cannot find model.model.layers in {type(model).__name__}")
    return layers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--input", required=True, help="safetensors with input_ids [B, S] int32/int64")
    ap.add_argument("--layers", required=True, help="comma-separated 0-based decoder layer ids")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = ap.parse_args()

    print(f"hf_taps: transformers {transformers.__version__}, torch {torch.__version__}")
    ids_list = [int(s) for s in args.layers.split(",") if s.strip() != ""]
    if not ids_list:
        raise SystemExit("hf_taps: --layers is empty")

    tensors, _ = load(args.input)
    if "input_ids" not in tensors:
        raise SystemExit(f"hf_taps: {args.input} has no input_ids (has {sorted(tensors)})")
    input_ids = tensors["input_ids"]
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise SystemExit(f"hf_taps: input_ids must be int32/int64 [B, S], got {input_ids.dtype} {list(input_ids.shape)}")
    input_ids = input_ids.to(torch.long)
    b, s = input_ids.shape

    dtype = DTYPES[args.dtype]
    model = load_model(args.model, dtype)
    model.eval()
    model.to(args.device)
    layers = decoder_layers(model)
    n_layers = len(layers)
    print(f"hf_taps: model class {type(model).__name__} ({type(model.model).__name__}), "
          f"{n_layers} decoder layers, dtype {dtype}, device {args.device}, input [{b}, {s}]")
    for lid in ids_list:
        if not 0 <= lid < n_layers:
            raise SystemExit(f"hf_taps: layer id {lid} out of range 0..{n_layers - 1}")

    captured = {}

    def make_hook(lid):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[lid] = out.detach().clone()

        return hook

    handles = [layers[lid].register_forward_hook(make_hook(lid)) for lid in sorted(set(ids_list))]
    try:
        with torch.no_grad():
            out = model(
                input_ids=input_ids.to(args.device),
                output_hidden_states=True,
                use_cache=False,
            )
    finally:
        for h in handles:
            h.remove()

    hs = out.hidden_states
    if hs is None or len(hs) != n_layers + 1:
        raise SystemExit(f"hf_taps: expected {n_layers + 1} hidden states, got {None if hs is None else len(hs)}")

    result = {"layers": torch.tensor(ids_list, dtype=torch.int32)}
    for lid in ids_list:
        hook_val = captured[lid]
        hs_val = hs[lid + 1]
        if hook_val.shape != hs_val.shape or hook_val.shape[:2] != (b, s):
            raise SystemExit(f"hf_taps: layer {lid}: hook {list(hook_val.shape)} vs hidden_states {list(hs_val.shape)}")
        same = torch.equal(hook_val, hs_val)
        if lid < n_layers - 1:
            if not same:
                diff = (hook_val.float() - hs_val.float()).abs().max().item()
                raise SystemExit(f"hf_taps: layer {lid}: hook output != hidden_states[{lid + 1}] (max diff {diff})")
            tap = hs_val
        else:
            tap = hook_val
            print(f"hf_taps: note: layer {lid} is the last decoder layer; hidden_states[{lid + 1}] "
                  f"{'equals' if same else 'is the final-norm output, not'} the raw layer output; "
                  f"writing the raw output (hook)")
        result[f"tap_{lid}"] = tap.to(torch.float32).cpu().contiguous()
        t = result[f"tap_{lid}"]
        print(f"hf_taps: tap_{lid} = output of decoder layer {lid}: {list(t.shape)} "
              f"mean|x| {t.abs().mean().item():.6g} max|x| {t.abs().max().item():.6g}")

    save(result, args.out)
    print(f"hf_taps: wrote {len(ids_list)} taps to {args.out}")


if __name__ == "__main__":
    main()
