//! Kernel throughput on the GPU, as a fraction of peaks measured in the same run: device-to-device
//! copy bandwidth (memory-bound kernels) and a cuBLASLt bf16 8192^3 GEMM (compute-bound ones).
//! Timings: warm-up excluded, median of repeated runs, inputs larger than L2 (so L2 stays out).
//! `cargo bench` on a GPU machine (prints a note and exits 0 without one).
//! `DFLASH_BENCH_KERNELS="cross-entropy;fc"` measures only the groups named (see `want` below);
//! `DFLASH_BENCH_REPS=N` times every row N times (after 2 warm-ups), e.g. 1 under ncu.
//! `DFLASH_PEERS=peers.json` (written by `tests/reference/bench_attention_peers.py` on the same GPU
//! just before) adds each attention row's peer time (cuDNN SDPA, FlexAttention with the DFlash
//! mask) and the speed ratio peer time / engine time (above 1: the engine is faster).

use std::time::Instant;

use dflash_engine::backend::cuda::{alloc::Mode, AttnForm, CudaBackend, FcPath, GdnForm, MlpForm};
use dflash_engine::backend::{AdamStep, Backend, DraftAttnShape, Gemm, OutGate, QkNormRope, Rows};
use dflash_engine::tensor::DType;

/// Median seconds of `reps` runs of `f` (each synchronised), after 2 warm-ups.
/// `DFLASH_BENCH_REPS=N` overrides every row's `reps` (e.g. 1 under a profiler such as ncu, so
/// each kernel is launched 3 times instead of 7 to 22).
fn time(be: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    let reps =
        std::env::var("DFLASH_BENCH_REPS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0).unwrap_or(reps);
    let s = be.compute_stream();
    for _ in 0..2 {
        f();
    }
    be.synchronize(&s).unwrap();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            be.synchronize(&s).unwrap();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[reps / 2]
}

/// Median seconds per call for the memory-bound kernels (and the copy peak they are measured
/// against): each sample times `calls` back-to-back calls and one synchronize, so the host's launch
/// and wake-up latency (~10 us: 5% of a 0.2 ms kernel, 2% of the 0.5 ms copy) is spread over the
/// calls instead of charged to each. Every buffer is larger than L2, so a call gains nothing from
/// the one before it.
fn time_per_call(be: &CudaBackend, reps: usize, calls: usize, mut f: impl FnMut()) -> f64 {
    time(be, reps, || {
        for _ in 0..calls {
            f();
        }
    }) / calls as f64
}

/// Back-to-back calls per sample in `time_per_call`.
const MEM_CALLS: usize = 5;

/// The peer a row is compared with (keys of `bench_attention_peers.py`'s output, and of
/// `bench_fla_gdn.py --peers`).
fn peer_key(name: &str) -> Option<String> {
    let sliding = if name.contains("sliding") { "_sliding" } else { "" };
    if name.starts_with("causal attention fwd") {
        if name.ends_with(" 128)") {
            return Some("causal128".into());
        }
        if name.ends_with(" 256)") {
            return Some("causal256".into());
        }
    }
    if name.starts_with("drafter attention fwd") {
        return Some(format!("draft_fwd{sliding}"));
    }
    if name.starts_with("drafter attention bwd") {
        return Some(format!("draft_bwd{sliding}"));
    }
    // The chunked gated delta rule: flash-linear-attention at the same shape
    // (tests/reference/bench_fla_gdn.py --peers).
    if name.starts_with("gdn chunked") {
        for shape in ["4 x 3072", "1 x 4096"] {
            if name.contains(&format!("({shape},")) {
                return Some(format!("gdn_fla_{}", shape.replace(" x ", "x")));
            }
        }
    }
    None
}

/// Peer milliseconds by key from `$DFLASH_PEERS`, or none (a missing or unreadable file is reported).
fn load_peers() -> std::collections::HashMap<String, f64> {
    let Ok(path) = std::env::var("DFLASH_PEERS") else { return Default::default() };
    match std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<std::collections::HashMap<String, f64>>(&t).map_err(|e| e.to_string()))
    {
        Ok(m) => m,
        Err(e) => {
            println!("peers: cannot read {path}: {e}");
            Default::default()
        }
    }
}

struct Row {
    name: String,
    secs: f64,
    value: f64,
    unit: &'static str,
    pct: f64,
}

fn main() {
    let be = match CudaBackend::new(0, Mode::Normal) {
        Ok(b) => b,
        Err(e) => {
            println!("no GPU benchmark: {e}");
            return;
        }
    };
    let s = be.compute_stream();
    let buf = |dt, n| be.alloc(&s, dt, n).unwrap();
    let ids = |v: Vec<i32>| {
        let mut b = be.alloc_ids(&s, v.len()).unwrap();
        be.upload_ids(&s, &v, &mut b).unwrap();
        b
    };
    let mut rows: Vec<Row> = Vec::new();
    // DFLASH_BENCH_KERNELS="pat;pat": only the groups (pack, norm, swiglu, cross-entropy, adamw,
    // decode, gdn-conv rmsnorm1p norm-rope, attention, gated-attention, gdn, fc, mlp, gemm-algos)
    // whose name contains a pattern; the peaks are always measured. gemm-model runs only when
    // named exactly.
    let only: Vec<String> = std::env::var("DFLASH_BENCH_KERNELS")
        .map(|v| v.split(';').map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect())
        .unwrap_or_default();
    let want = |group: &str| only.is_empty() || only.iter().any(|p| group.contains(p.as_str()));

    // Peaks.
    let n_copy = 1usize << 29; // 1 GiB of bf16
    let src = buf(DType::BF16, n_copy);
    let mut dst = buf(DType::BF16, n_copy);
    let t = time_per_call(&be, 10, MEM_CALLS, || be.copy(&s, &src, 0, &mut dst, 0, n_copy).unwrap());
    let peak_bw = 2.0 * (n_copy * 2) as f64 / t;
    drop((src, dst));
    // GEMM operands are random (train::flops::gemm_operand: zeros would flatter the clocks).
    let random = |n: usize, seed: u64| dflash_engine::train::flops::gemm_operand(&be, &s, n, seed).unwrap();
    let n = 8192;
    let (a, b) = (random(n * n, 1), random(n * n, 2));
    let mut c = buf(DType::BF16, n * n);
    let g = Gemm::linear(n, n, n);
    let t = time(&be, 10, || be.gemm(&s, &g, &a, 0, &b, 0, &mut c, 0).unwrap());
    let peak_flops = 2.0 * (n as f64).powi(3) / t;
    drop((a, b, c));
    println!(
        "measured peaks: copy {:.0} GB/s (read + write), cuBLASLt bf16 8192^3 {:.0} TFLOP/s",
        peak_bw / 1e9,
        peak_flops / 1e12
    );
    let mut mem = |name: &str, secs: f64, bytes: f64| {
        rows.push(Row {
            name: name.into(),
            secs,
            value: bytes / secs / 1e9,
            unit: "GB/s",
            pct: 100.0 * bytes / secs / peak_bw,
        })
    };

    // Random inputs for the memory-bound kernels: zero-filled buffers (alloc's default) are not
    // what they see in training, and zeros take other paths (swiglu's IEEE division g / (1 + e)
    // goes down its slow path for g == 0: ~2.3 TB/s instead of ~3.6; rmsnorm of a zero row is
    // 0 * (1 / sqrt(eps))). N(0, 1) values, one host block uploaded over each buffer from a
    // per-buffer starting point.
    let normals: Vec<f32> = {
        let mut r = dflash_engine::rng::Philox::new(2024, [7, 7]);
        (0..1usize << 22).map(|_| r.normal() as f32).collect()
    };
    let normal_buf = |dt: DType, n: usize, seed: usize| {
        let mut b = buf(dt, n);
        let start = seed.wrapping_mul(0x9E37_79B9) % normals.len();
        let mut off = 0;
        while off < n {
            let m = (n - off).min(normals.len() - start);
            be.upload(&s, &normals[start..start + m], &mut b, off).unwrap();
            off += m;
        }
        b
    };

    // Qwen3-8B shapes: 4 x 3072 target tokens, 512 anchors x 16 slots per sequence.
    let (t_rows, h, k_taps) = (4 * 3072, 4096, 5);
    if want("pack") {
        let taps: Vec<_> = (0..k_taps).map(|i| normal_buf(DType::BF16, t_rows * h, i)).collect();
        let refs: Vec<_> = taps.iter().collect();
        let mut packed = buf(DType::BF16, t_rows * k_taps * h);
        let bytes = 2.0 * 2.0 * (t_rows * k_taps * h) as f64;
        mem(
            "pack (5 taps, 12288 x 4096)",
            time_per_call(&be, 10, MEM_CALLS, || {
                be.pack_taps(&s, &refs, &mut packed, t_rows, h, t_rows, 0.0, 1, 1).unwrap()
            }),
            bytes,
        );
        mem(
            "pack + noise",
            time_per_call(&be, 10, MEM_CALLS, || {
                be.pack_taps(&s, &refs, &mut packed, t_rows, h, t_rows, 0.05, 1, 1).unwrap()
            }),
            bytes,
        );
        drop(refs);
        drop(taps);
    }
    if want("norm") {
        let rb = 32768;
        let x = normal_buf(DType::BF16, rb * h, 10);
        let mut w = buf(DType::BF16, h);
        be.upload(&s, &normals[..h].iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<f32>>(), &mut w, 0).unwrap();
        let mut y = buf(DType::BF16, rb * h);
        let mut r = buf(DType::F32, rb);
        mem(
            "rmsnorm fwd (32768 x 4096)",
            time_per_call(&be, 10, MEM_CALLS, || be.rmsnorm_fwd(&s, &x, &w, 0, &mut y, &mut r, rb, h, 1e-6).unwrap()),
            (rb * h * 4 + rb * 4 + h * 2) as f64,
        );
        let mut dx = buf(DType::BF16, rb * h);
        let mut dw = buf(DType::F32, h);
        // Every byte the backward moves: dy, x read and dx written, rstd and w, the f32 dw partial
        // sums (written by the main kernel, read by the reduce) and dw (read and written).
        let parts = dflash_engine::backend::cuda::rmsnorm_bwd_parts(rb, h);
        mem(
            "rmsnorm bwd (32768 x 4096)",
            time_per_call(&be, 10, MEM_CALLS, || {
                be.rmsnorm_bwd(&s, &y, &x, &w, 0, &r, &mut dx, false, &mut dw, 0, rb, h).unwrap()
            }),
            (rb * h * 6 + rb * 4 + h * 2 + 2 * parts * h * 4 + h * 8) as f64,
        );
        let pos = ids((0..rb as i32).map(|i| i % 3072).collect());
        mem(
            "rope (32768 x 32 x 128)",
            time_per_call(&be, 10, MEM_CALLS, || be.rope(&s, &mut y, &pos, rb, 32, 128, 1e6, false).unwrap()),
            (rb * h * 4) as f64,
        );
        drop((x, y, dx));
        // The Qwen3 target's per-head q/k norm and RoPE at the 8B shape (4 x 3072 rows, 32/8
        // heads of 128), read from the fused q|k|v projection. Bytes: q and k read and written.
        let (tr, qh, kh, hd) = (12288usize, 32usize, 8usize, 128usize);
        let qkv_w = (qh + 2 * kh) * hd;
        let qkv = normal_buf(DType::BF16, tr * qkv_w, 11);
        let mut wqk = buf(DType::BF16, 2 * hd);
        be.upload(&s, &normals[..2 * hd].iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<f32>>(), &mut wqk, 0).unwrap();
        let (mut qo, mut ko) = (buf(DType::BF16, tr * qh * hd), buf(DType::BF16, tr * kh * hd));
        let sh = QkNormRope {
            rows: tr,
            heads: qh,
            kv_heads: kh,
            head_dim: hd,
            eps: 1e-6,
            theta: 1e6,
            q_in: Rows { off: 0, stride: qkv_w },
            k_in: Rows { off: qh * hd, stride: qkv_w },
            q_out: Rows { off: 0, stride: qh * hd },
            k_out: Rows { off: 0, stride: kh * hd },
            wq_off: 0,
            wk_off: hd,
        };
        let tpos = ids((0..tr as i32).map(|i| i % 3072).collect());
        mem(
            "qk norm + rope (12288 x 32/8 x 128)",
            time_per_call(&be, 10, MEM_CALLS, || {
                be.qk_norm_rope(&s, &sh, &qkv, &qkv, &wqk, &mut qo, &mut ko, &tpos, None).unwrap()
            }),
            (tr * (qh + kh) * hd * 4) as f64,
        );
    }
    if want("swiglu") {
        let inter = 12288;
        let rs = 8192;
        let gu = normal_buf(DType::BF16, rs * 2 * inter, 20);
        let mut act = buf(DType::BF16, rs * inter);
        mem(
            "swiglu fwd (8192 x 12288)",
            time_per_call(&be, 10, MEM_CALLS, || be.swiglu_fwd(&s, &gu, &mut act, rs, inter).unwrap()),
            (rs * inter * 6) as f64,
        );
        // In place: each call turns gate|up into its gradient and dact into the activation (the
        // values do not change the time).
        let mut gu = gu;
        mem(
            "swiglu bwd (8192 x 12288)",
            time_per_call(&be, 10, MEM_CALLS, || be.swiglu_bwd(&s, &mut act, &mut gu, rs, inter).unwrap()),
            (rs * inter * 12) as f64,
        );
        drop((gu, act));
    }
    if want("cross-entropy") {
        // Cross-entropy overwrites its logits with the gradient, so every timed call gets its own copy
        // of the same N(0, 1) logits, restored (untimed) before each sample; every row is supervised
        // (weight 1, a valid label): zero weights would skip the exponentials and the gradient. At
        // 151,936 (Qwen3) the cluster kernel runs (one read per row), at 262,144 (Gemma) the
        // streaming one (two reads per row).
        for (ce_rows, vocab) in [(2048, 151_936), (1024, 262_144)] {
            let n = ce_rows * vocab;
            let pristine = normal_buf(DType::BF16, n, 30);
            let mut work: Vec<_> = (0..MEM_CALLS).map(|_| buf(DType::BF16, n)).collect();
            let labels = ids((0..ce_rows).map(|i| ((i * 7919) % vocab) as i32).collect());
            let mut wts = buf(DType::F32, ce_rows);
            be.upload(&s, &vec![1.0f32; ce_rows], &mut wts, 0).unwrap();
            let mut loss = buf(DType::F32, ce_rows);
            let mut am = be.alloc_ids(&s, ce_rows).unwrap();
            let mut samples: Vec<f64> = (0..12)
                .map(|_| {
                    for w in work.iter_mut() {
                        be.copy(&s, &pristine, 0, w, 0, n).unwrap();
                    }
                    be.synchronize(&s).unwrap();
                    let t0 = Instant::now();
                    for w in work.iter_mut() {
                        be.cross_entropy(&s, w, &labels, &wts, 0, ce_rows, vocab, 1.0, &mut loss, 0, &mut am, 0)
                            .unwrap();
                    }
                    be.synchronize(&s).unwrap();
                    t0.elapsed().as_secs_f64() / MEM_CALLS as f64
                })
                .skip(2)
                .collect();
            samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let kind = match be.cross_entropy_kernel(vocab) {
                (name, Some(n)) => format!("{name}, {n} clusters"),
                (name, None) => name.to_string(),
            };
            mem(
                &format!("cross-entropy fwd+bwd ({ce_rows} x {vocab}, {kind})"),
                samples[samples.len() / 2],
                (n * 4) as f64,
            );
        }
    }
    if want("adamw") {
        let np = 1usize << 28;
        let (mut p, gr, mut m, mut v) =
            (buf(DType::F32, np), buf(DType::F32, np), buf(DType::F32, np), buf(DType::F32, np));
        let mut wb = buf(DType::BF16, np);
        let hp = AdamStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, t: 3, grad_scale: 1.0 };
        mem(
            "adamw (268M params)",
            time_per_call(&be, 5, MEM_CALLS, || be.adamw(&s, &mut p, &gr, &mut m, &mut v, &mut wb, 0, &hp).unwrap()),
            (np * (4 * 4 + 3 * 4 + 2)) as f64,
        );
        let mut out = buf(DType::F32, 1);
        mem(
            "sum of squares (268M)",
            time_per_call(&be, 10, MEM_CALLS, || be.sum_squares(&s, &gr, &mut out).unwrap()),
            (np * 4) as f64,
        );
        drop((p, gr, m, v, wb));
    }

    // Decoding attention over a KV cache: bytes = the cache rows read (K and V) + q and o. Every
    // cache is larger than L2. c<N>: the split's target in CTAs per SM (the default: c2, c1 at
    // head_dim 256).
    if want("decode") {
        use dflash_engine::backend::cuda::DecodeTuning;
        use dflash_engine::backend::DecodeAttnShape;
        // (rows, heads, kv_heads, head_dim, context, cache rows per sequence)
        for (rows_, heads, kvh, hd, len, stride) in
            [(64, 32, 8, 128, 288, 320), (1, 32, 8, 128, 32768, 32768), (64, 24, 4, 256, 288, 320)]
        {
            let sh = DecodeAttnShape {
                rows: rows_,
                heads,
                kv_heads: kvh,
                head_dim: hd,
                row_stride: stride,
                len0: len,
                len_inc: 0,
            };
            let q = normal_buf(DType::BF16, rows_ * heads * hd, 11);
            let kc = normal_buf(DType::BF16, sh.cache_rows() * kvh * hd, 12);
            let vc = normal_buf(DType::BF16, sh.cache_rows() * kvh * hd, 13);
            let mut o = buf(DType::BF16, rows_ * heads * hd);
            let mut lse = buf(DType::F32, rows_ * heads);
            let bytes = (rows_ * len * kvh * hd * 2 * 2 + 2 * rows_ * heads * hd * 2) as f64;
            for c in [1, 2, 4] {
                let tuning = DecodeTuning { ctas_per_sm: c };
                let t = time_per_call(&be, 20, MEM_CALLS, || {
                    be.attn_decode_with(&s, &sh, &q, &kc, &vc, &mut o, &mut lse, tuning).unwrap()
                });
                mem(&format!("decode attention c{c} ({rows_} x {len}, {heads}/{kvh}, {hd})"), t, bytes);
            }
        }
    }

    if want("gdn-conv rmsnorm1p norm-rope") {
        // The Gated DeltaNet's convolution + SiLU + q/k L2 norms (gdn_conv_qkv) at the 27B shape:
        // 4 x 3072 rows of the f32 q|k|v projection (16 key heads of 128, 6144 value channels),
        // kernel size 4. Bytes: the f32 input read once and q, k, v written once.
        let (n, hk, dk, vd, ks) = (4 * 3072usize, 16usize, 128usize, 6144usize, 4usize);
        let sh = dflash_engine::backend::fused::GdnConvQkv {
            rows: n,
            k_heads: hk,
            k_dim: dk,
            value_dim: vd,
            kernel: ks,
            w_off: 0,
            eps: 1e-6,
            q_scale: 1.0 / (dk as f32).sqrt(),
        };
        let c = sh.channels();
        let x = normal_buf(DType::F32, n * c, 51);
        let w = normal_buf(DType::BF16, c * ks, 52);
        let (mut q, mut k, mut v) =
            (buf(DType::F32, n * hk * dk), buf(DType::F32, n * hk * dk), buf(DType::F32, n * vd));
        let starts = ids((0..=4).map(|b| b * 3072).collect());
        let t = time_per_call(&be, 10, MEM_CALLS, || {
            be.gdn_conv_qkv(&s, &sh, &x, &w, &starts, &mut q, &mut k, &mut v).unwrap()
        });
        mem("gdn conv + q/k norms (4 x 3072, 10240 ch, K 4)", t, 8.0 * (n * c) as f64);
        // The `1 + w` RMSNorm after each residual add (the adds ride on the output projections'
        // GEMMs), twice a layer at the 27B hidden size. Bytes: x read, y written.
        let hd = 5120;
        let (xr, wn) = (normal_buf(DType::BF16, n * hd, 53), normal_buf(DType::BF16, hd, 55));
        let mut yn = buf(DType::BF16, n * hd);
        let t = time_per_call(&be, 10, MEM_CALLS, || be.rmsnorm1p_fwd(&s, &xr, &wn, 0, &mut yn, n, hd, 1e-6).unwrap());
        mem("rmsnorm1p (12288 x 5120)", t, 4.0 * (n * hd) as f64);
        // The full-attention layer's per-head `1 + w` norm and partial RoPE of q (24 heads of 256,
        // 64 rotated, read from the q | gate projection at a stride of 512). Bytes: q read, y
        // written.
        let (heads, qd, rot) = (24usize, 256usize, 64usize);
        let sh = dflash_engine::backend::fused::NormRope {
            rows: n,
            heads,
            head_dim: qd,
            rot_dim: rot,
            theta: 1e7,
            eps: 1e-6,
            x_off: 0,
            x_stride: 2 * qd,
            w_off: 0,
        };
        let qg = normal_buf(DType::BF16, n * heads * 2 * qd, 56);
        let wq = normal_buf(DType::BF16, qd, 57);
        let mut yq = buf(DType::BF16, n * heads * qd);
        let pos = ids((0..n).map(|i| (i % 3072) as i32).collect());
        let t =
            time_per_call(&be, 10, MEM_CALLS, || be.rmsnorm1p_rope_partial(&s, &sh, &qg, &wq, &mut yq, &pos).unwrap());
        mem("rmsnorm1p + rope q (12288 x 24 x 256, rot 64)", t, 4.0 * (n * heads * qd) as f64);
    }

    // Compute-bound: attention (FLOPs counted for the visible keys only).
    let mut flops = |name: &str, secs: f64, f: f64| {
        rows.push(Row {
            name: name.into(),
            secs,
            value: f / secs / 1e12,
            unit: "TFLOP/s",
            pct: 100.0 * f / secs / peak_flops,
        })
    };
    if want("attention") {
        let (heads, kvh, hd) = (32, 8, 128);
        let mut o = buf(DType::BF16, t_rows * heads * hd);
        let starts = ids(vec![0, 3072, 6144, 9216, 12288]);
        let causal_f = 4.0 * 4.0 * (3072.0 * 3073.0 / 2.0) * heads as f64 * hd as f64;
        // Every kernel form on the same random inputs: the warp-specialised one (producer
        // warpgroup, mbarrier ring; the default), the plain Hopper warpgroup kernel and the
        // mma.sync one, as the in-run baselines; each row prints its ratio to the cuDNN peer.
        let (qr, kr, vr) = (
            normal_buf(DType::BF16, t_rows * heads * hd, 44),
            normal_buf(DType::BF16, t_rows * kvh * hd, 45),
            normal_buf(DType::BF16, t_rows * kvh * hd, 46),
        );
        for form in [AttnForm::WarpSpecialized, AttnForm::Wgmma, AttnForm::Mma] {
            let t = time(&be, 10, || {
                be.attn_causal_fwd_with(form, &s, &qr, &kr, &vr, &mut o, &starts, t_rows, heads, kvh, hd, None).unwrap()
            });
            flops(&format!("causal attention fwd {form:?} (4 x 3072, 32/8, 128)"), t, causal_f);
        }
        let nb = 4 * 512;
        let sh = DraftAttnShape {
            num_blocks: nb,
            block_size: 16,
            ctx_rows: t_rows,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            window: None,
        };
        let mut anchors = Vec::new();
        let mut cs = Vec::new();
        for b in 0..4 {
            for j in 0..512 {
                anchors.push(j * 6);
                cs.push(b * 3072);
            }
        }
        let visible: f64 = anchors.iter().map(|&a| f64::from(a) + 16.0).sum::<f64>() * 16.0;
        let (an, cst) = (ids(anchors), ids(cs));
        // N(0, 1) inputs like the causal rows and the peers (all-zero ones would time a different
        // kernel: every score equal, every output row zero, and the tensor cores drawing less power).
        let qd = normal_buf(DType::BF16, nb * 16 * heads * hd, 47);
        let kb = normal_buf(DType::BF16, nb * 16 * kvh * hd, 48);
        let vb = normal_buf(DType::BF16, nb * 16 * kvh * hd, 49);
        // The context keys and values: the causal rows' random K and V.
        let (k, vv) = (&kr, &vr);
        let mut od = buf(DType::BF16, nb * 16 * heads * hd);
        let mut lse = buf(DType::F32, nb * 16 * heads);
        // The three forward forms (the warp-specialised kernel is the default).
        for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
            let t = time(&be, 5, || {
                be.attn_draft_fwd_with(form, &s, &sh, &qd, k, vv, &kb, &vb, &an, &cst, &mut od, &mut lse).unwrap()
            });
            flops(
                &format!("drafter attention fwd {form:?} (2048 blocks x 16)"),
                t,
                4.0 * visible * heads as f64 * hd as f64,
            );
        }
        // The sliding-window layer (W 2048, causal inside the block), every form: FLOPs for the
        // keys each slot sees, min(a, W - 1 - r) context rows and r + 1 block rows.
        let win = 2048usize;
        let sh_sl = DraftAttnShape { window: Some(win), ..sh };
        let anchors_host: Vec<usize> = (0..4).flat_map(|_| (0..512).map(|j| j * 6)).collect();
        let visible_sl: f64 = anchors_host
            .iter()
            .map(|&a| (0..16usize).map(|r| (a.min((win - 1).saturating_sub(r)) + r + 1) as f64).sum::<f64>())
            .sum();
        for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
            let t = time(&be, 5, || {
                be.attn_draft_fwd_with(form, &s, &sh_sl, &qd, k, vv, &kb, &vb, &an, &cst, &mut od, &mut lse).unwrap()
            });
            flops(
                &format!("drafter attention fwd sliding {form:?} (2048 blocks x 16)"),
                t,
                4.0 * visible_sl * heads as f64 * hd as f64,
            );
        }
        // The backward in every form, full and sliding layers, each after its own layer's forward
        // (o and lse).
        let mut grads: Vec<_> =
            [nb * 16 * heads * hd, t_rows * kvh * hd, t_rows * kvh * hd, nb * 16 * kvh * hd, nb * 16 * kvh * hd]
                .iter()
                .map(|&n| buf(DType::BF16, n))
                .collect();
        let dout = normal_buf(DType::BF16, nb * 16 * heads * hd, 50);
        for (layer, shape, vis) in [("", &sh, visible), ("sliding ", &sh_sl, visible_sl)] {
            be.attn_draft_fwd(&s, shape, &qd, k, vv, &kb, &vb, &an, &cst, &mut od, &mut lse).unwrap();
            for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
                let t = time(&be, 5, || {
                    let [g0, g1, g2, g3, g4] = &mut grads[..] else { unreachable!() };
                    be.attn_draft_bwd_with(
                        form,
                        &s,
                        shape,
                        &qd,
                        k,
                        vv,
                        &kb,
                        &vb,
                        &an,
                        &cst,
                        &od,
                        &lse,
                        &dout,
                        [g0, g1, g2, g3, g4],
                    )
                    .unwrap()
                });
                flops(
                    &format!("drafter attention bwd {layer}{form:?} (2048 blocks x 16)"),
                    t,
                    10.0 * vis * heads as f64 * hd as f64,
                );
            }
        }
    }
    if want("gdn") {
        // The chunked gated delta rule at the Qwen3.6-27B shape (48 value heads over 16 key heads,
        // dk = dv = 128): 4 x 3072 and 1 x 4096 tokens. Unit-norm q and k (q scaled by dk^-0.5),
        // N(0, 1) values, decay exp(-0.1), beta 0.5. FLOPs: the chunk form's products (gdn.cu's
        // header), per chunk of L and value head.
        let (hk, hv, dk, dv) = (16usize, 48usize, 128usize, 128usize);
        let sh_flops = |lens: &[usize]| -> f64 {
            let per_chunk = |l: f64| {
                let (dk, dv) = (dk as f64, dv as f64);
                2.0 * (l * l / 2.0 * (2.0 * dk + dk + dv + dv) + 3.0 * l * dk * dv)
            };
            let mut f = 0.0;
            for &n in lens {
                let mut left = n;
                while left > 0 {
                    let l = left.min(dflash_engine::backend::GDN_CHUNK);
                    f += per_chunk(l as f64);
                    left -= l;
                }
            }
            f * hv as f64
        };
        for lens in [vec![3072usize; 4], vec![4096]] {
            let n: usize = lens.iter().sum();
            let mut q = buf(DType::F32, n * hk * dk);
            let mut k = buf(DType::F32, n * hk * dk);
            be.fill(&s, &mut q, 1.0 / dk as f32).unwrap();
            be.fill(&s, &mut k, 1.0 / (dk as f32).sqrt()).unwrap();
            let v = normal_buf(DType::F32, n * hv * dv, 31);
            let mut gl = buf(DType::F32, n * hv);
            be.fill(&s, &mut gl, -0.1).unwrap();
            let mut beta = buf(DType::BF16, n * hv);
            be.fill(&s, &mut beta, 0.5).unwrap();
            let mut o = buf(DType::BF16, n * hv * dv);
            let mut st = vec![0i32];
            for &l in &lens {
                st.push(st.last().unwrap() + l as i32);
            }
            let starts = ids(st);
            let sh = dflash_engine::backend::GdnShape { rows: n, k_heads: hk, v_heads: hv, k_dim: dk, v_dim: dv };
            // The fast split form (the default) beside the f32 split form and the
            // one-CTA-per-sequence kernels they replace.
            for form in [GdnForm::ChunkedSimt, GdnForm::ChunkedTc, GdnForm::ChunkedSplit, GdnForm::ChunkedFast] {
                let t = time(&be, 5, || {
                    be.gdn_launch(form, &s, &sh, [&q, &k, &v, &gl, &beta], &starts, &mut o, None).unwrap()
                });
                flops(&format!("gdn chunked {form:?} ({} x {}, 48/16, 128)", lens.len(), lens[0]), t, sh_flops(&lens));
            }
        }
    }
    if want("attention") {
        // Qwen3.6-27B full attention: 1 x 4096 tokens, 24/4 heads, head_dim 256.
        let (n, heads, kvh, hd) = (4096usize, 24usize, 4usize, 256usize);
        let q = normal_buf(DType::BF16, n * heads * hd, 41);
        let k = normal_buf(DType::BF16, n * kvh * hd, 42);
        let vv = normal_buf(DType::BF16, n * kvh * hd, 43);
        let mut o = buf(DType::BF16, n * heads * hd);
        let starts = ids(vec![0, n as i32]);
        let f = 4.0 * (n as f64 * (n as f64 + 1.0) / 2.0) * heads as f64 * hd as f64;
        // The three causal forms, as at head_dim 128.
        for form in [AttnForm::WarpSpecialized, AttnForm::Wgmma, AttnForm::Mma] {
            let t = time(&be, 10, || {
                be.attn_causal_fwd_with(form, &s, &q, &k, &vv, &mut o, &starts, n, heads, kvh, hd, None).unwrap()
            });
            flops(&format!("causal attention fwd {form:?} (1 x 4096, 24/4, 256)"), t, f);
        }
    }
    if want("gated-attention") {
        // The Qwen3.6-27B full-attention layer as the forward runs it (4 x 3072 tokens, 24/4
        // heads, head_dim 256, the gate the second half of each head's q_proj row): the gate in
        // the warp-specialised kernel's epilogue against the attention, then sigmoid_mul_strided.
        let (n, heads, kvh, hd) = (4 * 3072usize, 24usize, 4usize, 256usize);
        let q = normal_buf(DType::BF16, n * heads * hd, 44);
        let k = normal_buf(DType::BF16, n * kvh * hd, 45);
        let vv = normal_buf(DType::BF16, n * kvh * hd, 46);
        let qg = normal_buf(DType::BF16, n * heads * 2 * hd, 47);
        let mut o = buf(DType::BF16, n * heads * hd);
        let starts = ids((0..=4).map(|i| i * 3072).collect());
        let f = 4.0 * 4.0 * (3072.0 * 3073.0 / 2.0) * heads as f64 * hd as f64;
        let gate = OutGate { buf: &qg, off: hd, stride: 2 * hd };
        let form = AttnForm::WarpSpecialized;
        let fused = time(&be, 10, || {
            be.attn_causal_fwd_with(form, &s, &q, &k, &vv, &mut o, &starts, n, heads, kvh, hd, Some(gate)).unwrap()
        });
        let plain = time(&be, 10, || {
            be.attn_causal_fwd_with(form, &s, &q, &k, &vv, &mut o, &starts, n, heads, kvh, hd, None).unwrap()
        });
        let two = time(&be, 10, || {
            be.attn_causal_fwd_with(form, &s, &q, &k, &vv, &mut o, &starts, n, heads, kvh, hd, None).unwrap();
            be.sigmoid_mul_strided(&s, &mut o, &qg, hd, 2 * hd, n * heads, hd).unwrap()
        });
        flops("gated attention, gate in the epilogue (4 x 3072, 24/4, 256)", fused, f);
        flops("gated attention, then sigmoid_mul_strided (4 x 3072, 24/4, 256)", two, f);
        flops("attention alone, no gate (4 x 3072, 24/4, 256)", plain, f);
        println!("gated attention: epilogue / two passes = {:.3} (time ratio)", fused / two);
    }
    if want("fc") {
        // The FC projection at the recipe shape, random operands: cuBLASLt, then our kernel
        // (kernels/fc.cu, the fast path forced so a fallback cannot hide in the number).
        let xp = random(t_rows * k_taps * h, 3);
        let wfc = random(h * k_taps * h, 4);
        let mut yp = buf(DType::BF16, t_rows * h);
        let g = Gemm::linear(t_rows, h, k_taps * h);
        let fc_flops = 2.0 * (t_rows * h * k_taps * h) as f64;
        let t_lt = time(&be, 10, || be.gemm(&s, &g, &xp, 0, &wfc, 0, &mut yp, 0).unwrap());
        let t_fc = time(&be, 10, || {
            be.fc_project_with(&s, &xp, &wfc, 0, &mut yp, t_rows, h, k_taps * h, FcPath::Fast).unwrap()
        });
        flops("FC projection, cuBLASLt (12288 x 4096 x 20480)", t_lt, fc_flops);
        flops("FC projection, fc_wgmma_bf16 (12288 x 4096 x 20480)", t_fc, fc_flops);
        println!("fc kernel / cuBLASLt = {:.2} (throughput ratio on 12288 x 4096 x 20480)", t_lt / t_fc);
    }

    if want("mlp") {
        // The target's gate | up projection and SwiGLU at the two recipes' shapes (4 x 3072 rows),
        // and the 8B drafter's (2048 blocks of 16 rows), which keeps gate | up for its backward:
        // cuBLASLt's GEMM then swiglu_fwd, against kernels/mlp.cu's one kernel (forced, so a
        // fallback cannot hide in the number). Throughput counts the two projections' FLOPs.
        // Timed as in a model's forward: after the GPU reached its sustained (power-capped)
        // state, rounds of MLP_CALLS calls back to back per form, the two forms in turn (which
        // goes first alternating), the median round of each. Single calls with the GPU idle
        // between them ran at boost clocks and moved by 6% from one run to the next.
        const MLP_CALLS: usize = 20;
        warm_to_sustained(&be, &random);
        let shapes = [
            ("8B", t_rows, 12288, 4096, false),
            ("27B", t_rows, 17408, 5120, false),
            ("8B drafter", 32768, 12288, 4096, true),
        ];
        for (name, t_rows, inter, k, keep) in shapes {
            let x = random(t_rows * k, 5);
            let w = random(2 * inter * k, 6);
            let mut act = buf(DType::BF16, t_rows * inter);
            let mut gu = keep.then(|| buf(DType::BF16, t_rows * 2 * inter));
            let f = 4.0 * (t_rows * inter * k) as f64;
            let mut round = |form| {
                let t0 = Instant::now();
                for _ in 0..MLP_CALLS {
                    be.mlp_gate_up_act_with(&s, &x, &w, 0, &mut act, gu.as_mut(), t_rows, inter, k, form).unwrap();
                }
                be.synchronize(&s).unwrap();
                t0.elapsed().as_secs_f64() / MLP_CALLS as f64
            };
            let (mut two, mut fused) = (Vec::new(), Vec::new());
            for r in 0..6 {
                if r % 2 == 0 {
                    two.push(round(MlpForm::Gemm));
                    fused.push(round(MlpForm::Fused));
                } else {
                    fused.push(round(MlpForm::Fused));
                    two.push(round(MlpForm::Gemm));
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                v[v.len() / 2]
            };
            let (t_two, t_fused) = (median(&mut two), median(&mut fused));
            flops(&format!("{name} MLP gate|up + swiglu, cuBLASLt + swiglu_fwd ({t_rows} x {inter} x {k})"), t_two, f);
            flops(
                &format!("{name} MLP gate|up + swiglu, mlp_swiglu_wgmma_bf16 ({t_rows} x {inter} x {k})"),
                t_fused,
                f,
            );
            let kept = if keep { ", gate | up kept" } else { "" };
            println!(
                "mlp kernel / (cuBLASLt + swiglu_fwd) = {:.3} ({name} shape{kept}, throughput ratio, sustained: median of 6 rounds of {MLP_CALLS} calls)",
                t_two / t_fused
            );
        }
    }

    if want("gemm-algos") {
        // Every algorithm cuBLASLt's heuristic offers (best first; `gemm` runs the first) on the
        // largest GEMMs of the two recipes: how much a timed choice would gain over the heuristic's.
        let shapes = [
            ("27B MLP gate|up", Gemm::linear(12288, 34816, 5120), false),
            ("27B MLP down", Gemm::linear(12288, 5120, 17408), false),
            ("27B GDN q|k|v|z", Gemm::linear(12288, 10240 + 6144, 5120), false),
            ("8B MLP gate|up", Gemm::linear(12288, 24576, 4096), false),
            ("8B lm_head", Gemm::linear(2048, 151936, 4096), false),
            ("8B drafter dW gate|up", Gemm::linear_dw(32768, 24576, 4096), false),
        ];
        gemm_candidates(&be, &random, &shapes, 5);
    }

    // Named only (DFLASH_BENCH_KERNELS=gemm-model): about 20 s of GEMMs.
    if only.iter().any(|p| p == "gemm-model") {
        gemm_model(&be, &random);
        let shapes = [
            ("27B qkv (f32 out)", Gemm::linear(12288, 10240, 5120), true),
            ("27B z", Gemm::linear(12288, 6144, 5120), false),
            ("27B out / o", Gemm::linear(12288, 5120, 6144), false),
            ("27B q|gate", Gemm::linear(12288, 12288, 5120), false),
            ("27B MLP gate|up", Gemm::linear(12288, 34816, 5120), false),
            ("27B MLP down", Gemm::linear(12288, 5120, 17408), false),
            ("8B q|k|v", Gemm::linear(12288, 6144, 4096), false),
            ("8B MLP gate|up", Gemm::linear(12288, 24576, 4096), false),
            ("8B MLP down", Gemm::linear(12288, 4096, 12288), false),
            ("8B lm_head chunk", Gemm::linear(2048, 151936, 4096), false),
            ("8B drafter dW gate|up", Gemm::linear_dw(32768, 24576, 4096), false),
            ("8B drafter dX down", Gemm::linear_dx(32768, 4096, 12288, false), false),
        ];
        gemm_candidates(&be, &random, &shapes, 20);
    }

    let peers = load_peers();
    println!("\n{:<48} {:>10} {:>12} {:>8} {:>10} {:>8}", "kernel", "time", "throughput", "% peak", "peer", "vs peer");
    for r in &rows {
        let peer = peer_key(&r.name).and_then(|k| peers.get(&k).map(|ms| (k, *ms)));
        let vs = match peer {
            Some((_, ms)) => format!("{:>8.3}ms {:>7.2}x", ms, ms / (r.secs * 1e3)),
            None => String::new(),
        };
        println!("{:<48} {:>8.3}ms {:>7.0} {:<7} {:>5.1}% {vs}", r.name, r.secs * 1e3, r.value, r.unit, r.pct);
    }
    if !peers.is_empty() {
        println!("peers (ms): {}", {
            let mut v: Vec<_> = peers.iter().map(|(k, ms)| format!("{k} {ms:.3}")).collect();
            v.sort();
            v.join(", ")
        });
    }
    println!("\nallocator: {:?}", be.allocator_stats());
}

/// The Qwen3.6-27B forward's GEMMs (layers 0..61, 4 x 3072 tokens) without the rest of the
/// forward: each shape alone (the median of single calls, the GPU idle between them) against the
/// whole list back to back, and the largest one back to back for about a second. Whether the
/// GEMMs are slower in the model than alone, and whether the cause is the sequence or the
/// sustained load (the clocks; sample them beside this group with nvidia-smi). Then the list with
/// each shape's candidate picked by two tile rules, against the heuristic's first.
/// On the H200 (700 W cap) the list ran at 677-683 TFLOP/s back to back with the SM clock at
/// 1425-1500 MHz and the power-cap throttle reason set throughout, the single calls at 714-738;
/// the tile rules gained 0.9%.
fn gemm_model(be: &CudaBackend, random: &dyn Fn(usize, u64) -> <CudaBackend as Backend>::Buf) {
    let s = be.compute_stream();
    let m = 12288;
    // (name, n, k, f32 output): a Gated DeltaNet layer's projections, a full-attention layer's,
    // the MLP's.
    let linear =
        [("qkv", 10240, 5120, true), ("z", 6144, 5120, false), ("b|a", 96, 5120, false), ("out", 5120, 6144, false)];
    let full =
        [("q|gate", 12288, 5120, false), ("k", 1024, 5120, false), ("v", 1024, 5120, false), ("o", 5120, 6144, false)];
    let mlp = [("gate|up", 34816, 5120, false), ("down", 5120, 17408, false)];
    let a = random(m * 17408, 21);
    let shapes: Vec<_> = linear.iter().chain(&full).chain(&mlp).copied().collect();
    let ws: Vec<_> = shapes.iter().enumerate().map(|(i, &(_, n, k, _))| random(n * k, 30 + i as u64)).collect();
    let mut cs: Vec<_> = shapes
        .iter()
        .map(|&(_, n, _, f32_out)| be.alloc(&s, if f32_out { DType::F32 } else { DType::BF16 }, m * n).unwrap())
        .collect();
    let mut list = Vec::new();
    for l in 0..62 {
        let attn = if l % 4 == 3 { linear.len()..linear.len() + full.len() } else { 0..linear.len() };
        list.extend(attn.chain(shapes.len() - 2..shapes.len()));
    }
    let mut call_with = |i: usize, cand: usize| {
        let (_, n, k, _) = shapes[i];
        assert!(be.gemm_with(&s, &Gemm::linear(m, n, k), &a, 0, &ws[i], 0, None, &mut cs[i], 0, cand).unwrap());
    };
    let flop = |i: usize| 2.0 * (m * shapes[i].1 * shapes[i].2) as f64;
    println!("\nthe 27B forward's GEMMs (4 x 3072 tokens, layers 0..61), alone and in sequence:");
    let mut alone = vec![0.0; shapes.len()];
    for (i, t) in alone.iter_mut().enumerate() {
        *t = time(be, 10, || call_with(i, 0));
        let count = list.iter().filter(|&&j| j == i).count();
        println!(
            "  {:<8} {m}x{}x{}{}: {:.3} ms alone, {:.0} TFLOP/s; x {count}",
            shapes[i].0,
            shapes[i].1,
            shapes[i].2,
            if shapes[i].3 { " (f32 out)" } else { "" },
            *t * 1e3,
            flop(i) / *t / 1e12
        );
    }
    let total_flop: f64 = list.iter().map(|&i| flop(i)).sum();
    let sum_alone: f64 = list.iter().map(|&i| alone[i]).sum();
    let seq = time(be, 3, || list.iter().for_each(|&i| call_with(i, 0)));
    println!(
        "  sum of the single calls {:.1} ms ({:.0} TFLOP/s); the list back to back {:.1} ms ({:.0} TFLOP/s), {:.3}x the sum",
        sum_alone * 1e3,
        total_flop / sum_alone / 1e12,
        seq * 1e3,
        total_flop / seq / 1e12,
        seq / sum_alone
    );
    // The list under rules that pick among cuBLASLt's candidates by their tile, against the
    // heuristic's first: rounds of the three in turn, each policy's best round kept.
    let tiles: Vec<Vec<u32>> = shapes
        .iter()
        .map(|&(_, n, k, f32_out)| {
            let dt = if f32_out { DType::F32 } else { DType::BF16 };
            (0..dflash_engine::backend::cuda::blas::CANDIDATES)
                .map_while(|c| be.gemm_candidate(&Gemm::linear(m, n, k), dt, c).unwrap())
                .map(|d| d.tile.unwrap_or(0))
                .collect()
        })
        .collect();
    let pick = |rule: &dyn Fn(u32) -> bool| -> Vec<usize> {
        tiles.iter().map(|ts| ts.iter().position(|&t| rule(t)).unwrap_or(0)).collect()
    };
    let policies: [(&str, Vec<usize>); 3] = [
        ("heuristic's first", vec![0; shapes.len()]),
        ("first 256x128 tile", pick(&|t| t == 24)),
        ("first not 320x128 or 192x192", pick(&|t| t != 248 && t != 209)),
    ];
    for (i, ts) in tiles.iter().enumerate() {
        let picks: Vec<String> = policies.iter().map(|(_, p)| p[i].to_string()).collect();
        println!("  {:<8} candidate tiles {ts:?}; picks {}", shapes[i].0, picks.join(" / "));
    }
    let mut best = [f64::MAX; 3];
    for _ in 0..3 {
        for (b, (_, p)) in best.iter_mut().zip(&policies) {
            let t0 = Instant::now();
            list.iter().for_each(|&i| call_with(i, p[i]));
            be.synchronize(&s).unwrap();
            *b = b.min(t0.elapsed().as_secs_f64());
        }
    }
    for (b, (name, _)) in best.iter().zip(&policies) {
        println!(
            "  the list, {name:<30}: {:.1} ms ({:.0} TFLOP/s, {:.3}x the heuristic's)",
            b * 1e3,
            total_flop / b / 1e12,
            best[0] / b
        );
    }
    // The largest GEMM back to back: the first 10 calls and 400 calls (about a second).
    let big = shapes.len() - 2;
    for calls in [10, 400] {
        let t = time(be, 3, || (0..calls).for_each(|_| call_with(big, 0))) / calls as f64;
        println!(
            "  gate|up x {calls} back to back: {:.3} ms per call, {:.0} TFLOP/s ({:.3}x alone)",
            t * 1e3,
            flop(big) / t / 1e12,
            t / alone[big]
        );
    }
}

/// About 0.3 s of 8192^3 GEMMs back to back: the GPU's clocks settle at their sustained
/// (power-capped) state, where a model's kernels run.
fn warm_to_sustained(be: &CudaBackend, random: &dyn Fn(usize, u64) -> <CudaBackend as Backend>::Buf) {
    let s = be.compute_stream();
    let warm = Gemm::linear(8192, 8192, 8192);
    let (wa, wb) = (random(8192 * 8192, 41), random(8192 * 8192, 42));
    let mut wc = be.alloc(&s, DType::BF16, 8192 * 8192).unwrap();
    for _ in 0..200 {
        be.gemm(&s, &warm, &wa, 0, &wb, 0, &mut wc, 0).unwrap();
    }
    be.synchronize(&s).unwrap();
}

/// cuBLASLt's candidates for `shapes` (name, GEMM, f32 output) after the GPU has reached its
/// sustained (power-capped) state, as in a model's forward: each candidate runs `calls` calls back
/// to back, the candidates in turn, three rounds, each candidate's best round kept. The heuristic
/// ranks them at full clocks; under the cap the order can differ, and between calls it did (the
/// whole 27B list under tile rules gained 0.9%: gemm_model).
fn gemm_candidates(
    be: &CudaBackend,
    random: &dyn Fn(usize, u64) -> <CudaBackend as Backend>::Buf,
    shapes: &[(&str, Gemm, bool)],
    calls: usize,
) {
    use dflash_engine::backend::cuda::blas::CANDIDATES;
    let s = be.compute_stream();
    println!("\ncuBLASLt candidates under sustained load ({calls} calls back to back, best of 3 rounds), ms per call:");
    // Keep the GPU at its sustained state before the first shape.
    warm_to_sustained(be, random);
    for &(name, g, f32_out) in shapes {
        let (a, b) = (random(g.m * g.k, 51), random(g.k * g.n, 52));
        let mut c = be.alloc(&s, if f32_out { DType::F32 } else { DType::BF16 }, g.m * g.n).unwrap();
        let mut count = 0;
        while count < CANDIDATES && be.gemm_with(&s, &g, &a, 0, &b, 0, None, &mut c, 0, count).unwrap() {
            count += 1;
        }
        if count == 0 {
            println!("  {name:<22} {}x{}x{}: no candidate", g.m, g.n, g.k);
            continue;
        }
        let mut best = vec![f64::MAX; count];
        for _ in 0..3 {
            for (i, t) in best.iter_mut().enumerate() {
                let t0 = Instant::now();
                for _ in 0..calls {
                    be.gemm_with(&s, &g, &a, 0, &b, 0, None, &mut c, 0, i).unwrap();
                }
                be.synchronize(&s).unwrap();
                *t = t.min(t0.elapsed().as_secs_f64() / calls as f64);
            }
        }
        let tf = |t: f64| 2.0 * (g.m * g.n * g.k) as f64 / t / 1e12;
        let (bi, bt) = best.iter().enumerate().fold((0, f64::MAX), |m, (i, &t)| if t < m.1 { (i, t) } else { m });
        let dt = if f32_out { DType::F32 } else { DType::BF16 };
        let what = |i: usize| be.gemm_candidate(&g, dt, i).unwrap().unwrap_or_default();
        let list: Vec<String> = best
            .iter()
            .enumerate()
            .map(|(i, t)| format!("{:.3}/t{}", t * 1e3, what(i).tile.map_or("?".into(), |t| t.to_string())))
            .collect();
        println!(
            "  {name:<22} {}x{}x{}: [{}]; first {:.0} TFLOP/s ({}), best #{bi} {:.0} TFLOP/s ({:.3}x; {})",
            g.m,
            g.n,
            g.k,
            list.join(" "),
            tf(best[0]),
            what(0),
            tf(bt),
            best[0] / bt,
            what(bi)
        );
    }
}
