#!/usr/bin/env python3
"""Plain-torch autograd oracle for the DFlash drafter step (DFLASH.md sections 2-4).

    python3 drafter_ref.py --case CASE.safetensors --out OUT.safetensors \
        [--device cuda] [--dtype float32|float64] [--extra]

Written from DFLASH.md, not from the Rust: every op is the textbook formula, attention uses an
explicit boolean mask over [context rows ; block rows], and torch autograd gives the gradients.
See tests/reference/README.md for the file protocol.
"""

import argparse
import math
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _stio import load, save  # noqa: E402

INPUT_NAMES = ["x", "embed", "lm_head", "ctx_pos", "block_ids", "block_pos", "anchors", "ctx_start", "labels", "weights"]
META_KEYS = ["heads", "kv_heads", "head_dim", "block_size", "layers", "rms_eps", "norm_eps", "rope_theta"]
LAYER_PARAMS = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def param_names(n_layers):
    names = ["fc.weight", "hidden_norm.weight"]
    for i in range(n_layers):
        names += [f"layers.{i}.{p}" for p in LAYER_PARAMS]
    names.append("norm.weight")
    return names


def rms_norm(x, w, eps):
    """x * rsqrt(mean(x^2) + eps) * w over the last dim (Qwen3 convention: weight, not 1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE. x: [rows, heads, hd]; pos: [rows] int. inv_freq_i = 1 / theta^(2i/hd),
    angle = pos * inv_freq_i, applied to the pairs (i, i + hd/2). Angles are computed in float64
    and cos/sin rounded once to x's dtype."""
    hd = x.shape[-1]
    half = hd // 2
    i = torch.arange(half, dtype=torch.float64, device=x.device)
    inv_freq = 1.0 / (float(theta) ** (2.0 * i / hd))
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # [rows, half]
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos + rot * sin


def build_mask(anchors, ctx_start, n_ctx, bs, window=0):
    """Boolean [Nb*bs, T + Nb*bs]: query slot of block j sees context row t iff
    ctx_start[j] <= t < ctx_start[j] + anchors[j] (strictly before the anchor), and every slot of
    its own block (bidirectional); never other blocks. A padded block (anchor < 0) sees nothing.
    window W > 0 (a sliding_attention layer): slot r additionally needs
    t - ctx_start[j] >= anchors[j] + r - (W - 1) (the draft token takes one place in the window),
    and sees only the slots <= r of its own block (causal inside the block)."""
    nb = anchors.shape[0]
    dev = anchors.device
    a = anchors.to(torch.long)
    cs = ctx_start.to(torch.long)
    valid = a >= 0  # [Nb]
    t = torch.arange(n_ctx, device=dev)
    ctx_vis = (t[None, :] >= cs[:, None]) & (t[None, :] < cs[:, None] + a[:, None]) & valid[:, None]  # [Nb, T]
    blk = torch.arange(nb, device=dev)
    blk_vis = (blk[:, None] == blk[None, :]) & valid[:, None]  # [Nb, Nb]
    ctx_vis = ctx_vis.repeat_interleave(bs, dim=0)  # [Nb*bs, T]
    blk_vis = blk_vis.repeat_interleave(bs, dim=0).repeat_interleave(bs, dim=1)  # [Nb*bs, Nb*bs]
    if window > 0:
        r = torch.arange(nb * bs, device=dev) % bs  # slot of each query row
        a_row = a.repeat_interleave(bs)
        cs_row = cs.repeat_interleave(bs)
        lo = a_row + r - (window - 1)  # first visible position, relative to the sequence
        ctx_vis = ctx_vis & ((t[None, :] - cs_row[:, None]) >= lo[:, None])
        slot_k = torch.arange(nb * bs, device=dev) % bs
        blk_vis = blk_vis & (slot_k[None, :] <= r[:, None])
    return torch.cat([ctx_vis, blk_vis], dim=1)


def masked_attention(q, k, v, mask, scale):
    """q: [Tq, nq, hd]; k, v: [Tk, nkv, hd]; mask: [Tq, Tk] bool. GQA: q head h uses kv head
    h // (nq / nkv). Rows with no visible key output exactly 0 (no NaN, zero gradient)."""
    nq, nkv = q.shape[1], k.shape[1]
    assert nq % nkv == 0, f"heads {nq} not a multiple of kv_heads {nkv}"
    g = nq // nkv
    k = k.repeat_interleave(g, dim=1)  # [Tk, nq, hd]
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [nq, Tq, Tk]
    any_vis = mask.any(dim=1)  # [Tq]
    m = mask[None, :, :]
    scores = scores.masked_fill(~m, float("-inf"))
    # All-masked rows: give softmax finite inputs, then select 0 for them.
    scores = torch.where(any_vis[None, :, None], scores, torch.zeros_like(scores))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(any_vis[None, :, None], p, torch.zeros_like(p))
    return torch.einsum("hqk,khd->qhd", p, v)  # [Tq, nq, hd]


def forward_loss(P, inp, cfg):
    """Returns (loss, logits, per-row CE, ctx, final hidden). P: dict name -> param tensor."""
    nq, nkv, hd, bs = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
    rms_eps, norm_eps, theta = cfg["rms_eps"], cfg["norm_eps"], cfg["rope_theta"]
    x_taps = inp["x"]
    n_ctx = x_taps.shape[0]

    # Section 2: ctx = RMSNorm_hidden(X Wfc^T), shared by all layers.
    ctx = rms_norm(x_taps @ P["fc.weight"].T, P["hidden_norm.weight"], norm_eps)  # [T, H]

    # Block stream: embed[block_ids] (padded blocks may carry any id; clamp negatives to 0).
    ids = inp["block_ids"].to(torch.long).clamp(min=0)
    x = inp["embed"][ids]  # [Tb, H]
    tb = x.shape[0]

    windows = cfg["layer_windows"]
    masks = {w: build_mask(inp["anchors"], inp["ctx_start"], n_ctx, bs, w) for w in set(windows)}
    bpos = inp["block_pos"].to(torch.long)
    cpos = inp["ctx_pos"].to(torch.long)
    scale = hd ** -0.5

    for i in range(cfg["layers"]):
        w = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        xn = rms_norm(x, w("input_layernorm.weight"), rms_eps)
        q = (xn @ w("self_attn.q_proj.weight").T).view(tb, nq, hd)
        q = rms_norm(q, w("self_attn.q_norm.weight"), rms_eps)
        kv_in = torch.cat([ctx, xn], dim=0)  # [T + Tb, H]
        k = (kv_in @ w("self_attn.k_proj.weight").T).view(n_ctx + tb, nkv, hd)
        k = rms_norm(k, w("self_attn.k_norm.weight"), rms_eps)
        v = (kv_in @ w("self_attn.v_proj.weight").T).view(n_ctx + tb, nkv, hd)
        q = rope(q, bpos, theta)
        k = rope(k, torch.cat([cpos, bpos], dim=0), theta)
        o = masked_attention(q, k, v, masks[windows[i]], scale).reshape(tb, nq * hd)
        x = x + o @ w("self_attn.o_proj.weight").T
        h2 = rms_norm(x, w("post_attention_layernorm.weight"), rms_eps)
        gate = h2 @ w("mlp.gate_proj.weight").T
        up = h2 @ w("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w("mlp.down_proj.weight").T

    h = rms_norm(x, P["norm.weight"], norm_eps)
    logits = h @ inp["lm_head"].T  # [Tb, V]

    # Section 4: loss = sum(w * CE) / sum(w) over rows with w > 0 (labels NOT shifted).
    wts = inp["weights"]
    labels = inp["labels"].to(torch.long)
    sel = wts > 0
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ce = torch.where(sel, lse - picked, torch.zeros_like(lse))
    wsum = wts[sel].sum()
    if bool(sel.any()):
        loss = (wts * ce).sum() / wsum
    else:
        loss = (logits * 0).sum()
    return loss, logits, ce, ctx, h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--extra", action="store_true", help="also write ctx, hidden, ce")
    args = ap.parse_args()

    # Exact fp32/fp64 matmuls: no TF32 anywhere.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    dev = torch.device(args.device)
    tensors, meta = load(args.case)

    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise SystemExit(f"drafter_ref: metadata lacks {missing} (has {sorted(meta)})")
    cfg = {k: int(meta[k]) for k in ["heads", "kv_heads", "head_dim", "block_size", "layers"]}
    cfg.update({k: float(meta[k]) for k in ["rms_eps", "norm_eps", "rope_theta"]})
    # Optional: the attention window of each layer, comma separated, 0 = full_attention
    # (absent: every layer full).
    lw = meta.get("layer_windows")
    cfg["layer_windows"] = [int(x) for x in lw.split(",")] if lw else [0] * cfg["layers"]
    if len(cfg["layer_windows"]) != cfg["layers"] or any(w < 0 for w in cfg["layer_windows"]):
        raise SystemExit(f"drafter_ref: layer_windows {lw!r} must list {cfg['layers']} windows >= 0")

    names = param_names(cfg["layers"])
    missing = [n for n in INPUT_NAMES + names if n not in tensors]
    if missing:
        raise SystemExit(f"drafter_ref: case lacks tensors {missing}")
    extra = sorted(set(tensors) - set(INPUT_NAMES) - set(names))
    if extra:
        print(f"drafter_ref: note: ignoring unknown tensors {extra}")

    inp = {}
    for n in INPUT_NAMES:
        t = tensors[n]
        inp[n] = (t.to(dtype) if t.is_floating_point() else t).to(dev)
    P = {n: tensors[n].to(dtype).to(dev).requires_grad_(True) for n in names}

    # Shape and protocol checks.
    nb, bs = inp["anchors"].shape[0], cfg["block_size"]
    tb = inp["block_ids"].shape[0]
    v_size, hid = inp["embed"].shape
    assert tb == nb * bs, f"block_ids has {tb} rows, anchors {nb} x block_size {bs}"
    for n in ["block_pos", "labels", "weights"]:
        assert inp[n].shape == (tb,), f"{n} shape {list(inp[n].shape)} != [{tb}]"
    assert inp["ctx_start"].shape == (nb,), "ctx_start must be [Nb]"
    assert inp["ctx_pos"].shape == (inp["x"].shape[0],), "ctx_pos must be [T]"
    assert inp["lm_head"].shape == (v_size, hid), "lm_head must be [V, H] like embed"
    assert P["fc.weight"].shape == (hid, inp["x"].shape[1]), "fc.weight must be [H, K*H]"
    assert bool((inp["weights"] >= 0).all()), "negative loss weight"
    sup = inp["weights"] > 0
    lab = inp["labels"].to(torch.long)
    assert bool(((lab[sup] >= 0) & (lab[sup] < v_size)).all()), "a supervised row has no valid label"
    assert bool((inp["block_ids"].to(torch.long) < v_size).all()), "block id >= vocab"

    loss, logits, ce, ctx, h = forward_loss(P, inp, cfg)
    if not torch.isfinite(loss):
        raise SystemExit(f"drafter_ref: non-finite loss {loss.item()}")
    loss.backward()

    out = {"loss": loss.detach().to(torch.float32).reshape(1).cpu()}
    gmax, gsq = 0.0, 0.0
    for n in names:
        g = P[n].grad
        if g is None:
            g = torch.zeros_like(P[n])
        if not bool(torch.isfinite(g).all()):
            raise SystemExit(f"drafter_ref: non-finite gradient in {n}")
        gmax = max(gmax, g.abs().max().item())
        gsq += g.double().pow(2).sum().item()
        out[f"grad.{n}"] = g.detach().to(torch.float32).cpu()
    argmax = logits.detach().argmax(dim=-1)
    out["argmax"] = argmax.to(torch.int32).cpu()
    if args.extra:
        out["ctx"] = ctx.detach().to(torch.float32).cpu()
        out["hidden"] = h.detach().to(torch.float32).cpu()
        out["ce"] = ce.detach().to(torch.float32).cpu()
    save(out, args.out)

    padded = int((inp["anchors"] < 0).sum().item())
    acc = (argmax[sup] == lab[sup]).double().mean().item() if bool(sup.any()) else float("nan")
    print(
        f"drafter_ref: loss {loss.item():.9g} ({args.dtype}, {dev}) blocks {nb} (padded {padded}) bs {bs} "
        f"ctx {inp['x'].shape[0]} supervised {int(sup.sum())} sum_w {inp['weights'][sup].sum().item():.6g} "
        f"acc {acc:.4f} grad_norm {math.sqrt(gsq):.6g} grad_max {gmax:.6g} -> {args.out}"
    )


if __name__ == "__main__":
    main()
