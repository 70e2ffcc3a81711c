// Launch geometry the kernels and their Rust launchers share: block sizes, tile sizes, shared-memory
// layouts, argument limits. This file is the one place they are written down. The kernels include
// it; build.rs parses it into Rust constants (`crate::kernels::launch`), so a launcher never restates
// a number from a .cu file.
//
// Format (build.rs reads it): one `constexpr <int type> NAME = <expression>;` per line, the
// expression made of integer literals, earlier names, + - * / << and parentheses. Comments say why
// each value is what it is; the kernel file named in each section explains more.
#pragma once

// ---- attention.cu ----------------------------------------------------------------------------
// Row pitch padding of every K/V/Q tile in shared memory, in bf16 elements (LD = head_dim + 8):
// 16 bytes that put consecutive rows in different banks for ldmatrix.
constexpr int ATTN_LD_PAD = 8;
// Query rows one warp owns: the M of one m16n8k16 MMA.
constexpr int ATTN_WARP_ROWS = 16;
// Keys per K/V tile of the drafter kernels: a 16 x 64 S tile is 32 f32 registers per thread.
constexpr int ATTN_KEYS = 64;
// K/V tiles in flight (double-buffered K and V: 4 tiles of shared memory).
constexpr int ATTN_KV_TILES = 4;
// Causal forward: 4 warps x 2 m-tiles = 128 query rows of one head per CTA, 32-key K/V tiles.
constexpr int ATTN_CAUSAL_WARPS = 4;
constexpr int ATTN_CAUSAL_MT = 2;
constexpr int ATTN_CAUSAL_KEYS = 32;
constexpr int ATTN_CAUSAL_ROWS = ATTN_CAUSAL_WARPS * ATTN_CAUSAL_MT * ATTN_WARP_ROWS;
// Causal forward at head_dim 256: one m-tile per warp (the O accumulators alone are 128
// registers), so 64 query rows per CTA.
constexpr int ATTN_CAUSAL_MT_HD256 = 1;
constexpr int ATTN_CAUSAL_ROWS_HD256 = ATTN_CAUSAL_WARPS * ATTN_CAUSAL_MT_HD256 * ATTN_WARP_ROWS;
// Drafter query tile limit: block_size * G rows, at most 8 warps.
constexpr int ATTN_DRAFT_MAX_ROWS = 128;
// Drafter backward over context: 64 context rows (keys) per CTA, 4 warps of 16 keys each; the
// query rows of a block are consumed in chunks of 32.
constexpr int ATTN_KV_ROWS = 64;
constexpr int ATTN_KV_WARPS = ATTN_KV_ROWS / ATTN_WARP_ROWS;
constexpr int ATTN_KV_CHUNK = 32;
// Block keys in the f32 P / dS side buffers of attn_draft_bwd_q: block_size <= 16.
constexpr int ATTN_MAX_BLOCK_KEYS = 16;

// ---- attention_wgmma.cu ----------------------------------------------------------------------
// Hopper causal forward: 2 warpgroups of 64 query rows (the M of one wgmma) = 128 rows of one
// head per CTA, 256 threads.
constexpr int ATTN_WG_WARPGROUPS = 2;
constexpr int ATTN_WG_THREADS = ATTN_WG_WARPGROUPS * 128;
constexpr int ATTN_WG_ROWS = ATTN_WG_WARPGROUPS * 64;
// Keys per K/V tile: 128 at head_dim 128 (S = 64 registers, O = 64: an n128 wgmma reads 6 KB of
// shared memory per 64 tensor-core cycles, under the 128 B/cycle port), 64 at head_dim 256 (O alone
// is 128 registers).
constexpr int ATTN_WG_KEYS_HD128 = 128;
constexpr int ATTN_WG_KEYS_HD256 = 64;
// K/V stages: tile t + 1 loads while tile t's S = Q K^T and tile t - 1's O += P V run, so K
// needs 2 stages and V 3. Shared memory: (ROWS + (K_STAGES + V_STAGES) * KEYS) * hd * 2 + 1024
// bytes (alignment slack for the 1024-byte swizzle atoms): 197,632 at hd 128, 230,400 at hd 256
// (of the 232,448 an H100/H200 CTA may opt in to): one CTA per SM.
constexpr int ATTN_WG_K_STAGES = 2;
constexpr int ATTN_WG_V_STAGES = 3;
constexpr int ATTN_WG_ALIGN = 1024;
// The drafter forward's own block keys (block_size <= 16): one 16-row K and V tile per warpgroup
// on top of the causal layout (4 * 16 * hd * 2 bytes more: 214,016 at hd 128).
constexpr int ATTN_WG_BLOCK_KEYS = 16;
// The drafter backward over queries (attn_draft_bwd_q_wg): 64-key context tiles (S, dP = 32
// registers each beside the 64 of dQ), K in 3 stages (tile t's K serves S_t and, one iteration
// later, dQ += dS_t K_t) and V in 2 (dP_t only). Shared memory:
// (2 * ROWS + (K_STAGES + V_STAGES) * KEYS + 4 * BLOCK_KEYS) * hd * 2 + 4 * 64 * BLOCK_KEYS * 4
// (f32 P and dS of the block keys per warpgroup) + 1024 = 181,248 bytes at hd 128.
constexpr int ATTN_WG_BWD_KEYS = 64;
constexpr int ATTN_WG_BWD_K_STAGES = 3;
constexpr int ATTN_WG_BWD_V_STAGES = 2;
// The drafter backward over context keys (attn_draft_bwd_kv_wg): 64 context keys per warpgroup,
// ATTN_WG_BWD_KV_ROWS per CTA; each visible block's 64-row Q and dO tiles (rows past M zero) in 2
// stages. Shared memory: (2 * KV_ROWS + 2 * 2 * 64) * hd * 2 + 2 * 2 * 64 * 4 (lse, dsum) + 1024 =
// 133,120 bytes at hd 128, plus the static visible-block list.
constexpr int ATTN_WG_BWD_KV_ROWS = ATTN_WG_WARPGROUPS * 64;

// The warp-specialised causal forward (attention_wgmma.cu section 5): a producer warpgroup that
// alone moves Q, K and V (TMA, or cp.async for tiles a sequence start cuts; completion on
// per-stage "full" mbarriers) and the two
// consumer warpgroups of the layout above (wgmma; each frees a stage on its "empty" mbarrier):
// 384 threads. Registers move from the producer to the consumers with setmaxnreg: 128 * 24 +
// 256 * 240 = 64,512 of the SM's 65,536 (the kernel is compiled for 384 threads, i.e. 168 each).
constexpr int ATTN_WS_THREADS = (ATTN_WG_WARPGROUPS + 1) * 128;
constexpr int ATTN_WS_PRODUCER_REGS = 24;
constexpr int ATTN_WS_CONSUMER_REGS = 240;
// K/V stages. A K stage is free once S = Q K^T of its tile has completed (within the same
// iteration), a V stage once O += P V has (one iteration later), so V needs a stage more than K to
// let the producer run the same distance ahead. Shared memory: (ROWS + (K_STAGES + V_STAGES) *
// KEYS) * hd * 2 + BAR_BYTES + 1024 bytes = 230,528 at hd 128 (3 + 3 stages of 128 keys) and at hd
// 256 (2 + 3 stages of 64 keys).
constexpr int ATTN_WS_K_STAGES_HD128 = 3;
constexpr int ATTN_WS_K_STAGES_HD256 = 2;
constexpr int ATTN_WS_V_STAGES = 3;
// The warp-specialised drafter forward (section 6): K/V stages of ATTN_WG_KEYS_HD128 keys beside
// the 128-row Q tile and the 4 block-key tiles: (128 + (2 + 3) * 128 + 4 * 16) * 256 + 128 + 1024 =
// 214,144 bytes.
constexpr int ATTN_WS_DRAFT_K_STAGES = 2;
constexpr int ATTN_WS_DRAFT_V_STAGES = 3;
// The warp-specialised drafter backward over context keys (section 7): the 128 context rows' K and
// V once, and each visible block's 64-row Q and dO tiles with its 64 lse * log2(e) and dsum values
// and a 16-byte descriptor in a ring of BWD_Q_STAGES stages: 2 * 128 * 256 + 4 * (2 * 64 * 256 +
// 512 + 16) + 128 + 1024 = 199,872 bytes.
constexpr int ATTN_WS_BWD_Q_STAGES = 4;
// The warp-specialised drafter backward over queries (section 8): section 3's layout (Q and dO of
// both blocks, 64-key context tiles, the block keys and the f32 P and dS of the block keys) with
// K in BWD_K_STAGES stages (tile t's K serves S_t and, one iteration later, dQ += dS_t K_t) and V
// in BWD_V_STAGES: (2 * 128 + (4 + 3) * 64 + 4 * 16) * 256 + 4 * 64 * 16 * 4 + 128 + 1024 =
// 214,144 bytes.
constexpr int ATTN_WS_BWD_KEYS = 64;
constexpr int ATTN_WS_BWD_K_STAGES = 4;
constexpr int ATTN_WS_BWD_V_STAGES = 3;
// Consumer ping-pong (attention_wgmma.cu sections 5 and 6): 1 = the two consumers issue their wgmma
// batches in turns (named barriers 2 and 3), 0 = independently.
constexpr int ATTN_WS_PINGPONG = 1;
// The mbarriers (8 bytes each): Q full, then a full and an empty one per K and per V stage; 16
// slots, room for 7 + 7 stages.
constexpr int ATTN_WS_BAR_BYTES = 128;

// ---- cross_entropy.cu ------------------------------------------------------------------------
// Threads per CTA of the streaming kernel (one CTA per row): 16 warps.
constexpr int CE_BLOCK = 512;
// Cluster kernels: clusters of 8 CTAs of 512 threads, a 2-stage ring of row shares per CTA; each
// thread owns CEC_CHUNKS (first kernel) or CEC_WIDE_CHUNKS (wide kernel) chunks of 8 of the row.
constexpr int CEC_CTAS = 8;
constexpr int CEC_BLOCK = 512;
constexpr int CEC_STAGES = 2;
constexpr int CEC_CHUNKS = 5;
constexpr int CEC_WIDE_CHUNKS = 8;

// ---- fc.cu -----------------------------------------------------------------------------------
// fc_wgmma_bf16: 128 x 256 output tiles, K stages of 64 (one 128-byte swizzle row), a 4-deep ring,
// 384 threads (a producer warpgroup and 2 consumer warpgroups).
constexpr int FC_BM = 128;
constexpr int FC_BN = 256;
constexpr int FC_BK = 64;
constexpr int FC_STAGES = 4;
constexpr int FC_THREADS = 384;
// 128-byte swizzle atom (8 rows x 128 bytes): the ring starts on one.
constexpr int FC_SWIZZLE_ALIGN = 1024;
// The ring's bf16 stages, a full and an empty 8-byte barrier per stage, and the alignment slack.
constexpr int FC_SMEM_BYTES = FC_STAGES * (FC_BM + FC_BN) * FC_BK * 2 + 2 * FC_STAGES * 8 + FC_SWIZZLE_ALIGN;
// fc_simple_bf16: 64 x 64 output tiles, 256 threads (16 x 16, 4 x 4 outputs each).
constexpr int FC_S_TILE = 64;
constexpr int FC_S_THREADS = 256;

// ---- mlp.cu ----------------------------------------------------------------------------------
// mlp_swiglu_wgmma_bf16: fc_wgmma_bf16's roles and K stages (FC_BM rows, FC_BK, FC_THREADS) with
// MLP_BN output columns per tile: their MLP_BN gate and MLP_BN up columns are one 2 * MLP_BN-wide
// wgmma (the same shared-memory bytes per stage as fc's 256-wide tile).
constexpr int MLP_BN = 128;
// The ring is one stage shorter than fc's: the staging tile below takes its 48 KB and 20 KB more.
constexpr int MLP_STAGES = 3;
// The epilogue hands each finished tile to the producer warpgroup's three idle warps through a
// staging tile of FC_BM rows x MLP_BN (gate, up) bf16 pairs, a row 512 bytes of pairs and 32 of
// padding (so the consumers' 8-byte stores of 8 rows meet no bank conflict).
constexpr int MLP_STAGING_PITCH = 2 * 2 * MLP_BN + 32;
// The ring's stages, the staging tile, the ring's full and empty barriers and the staging tile's
// full and empty barrier, and the alignment slack.
constexpr int MLP_SMEM_BYTES = MLP_STAGES * (FC_BM + 2 * MLP_BN) * FC_BK * 2 + FC_BM * MLP_STAGING_PITCH + (2 * MLP_STAGES + 2) * 8 + FC_SWIZZLE_ALIGN;

// ---- pack.cu ---------------------------------------------------------------------------------
// Most tapped layers one call packs: TapPtrs stays at 128 bytes of kernel parameters.
constexpr int MAX_TAPS = 16;
// Units (8 bf16, 16 bytes) each thread of the fast path owns per work item.
constexpr int PACK_UNITS = 4;
// Launch bounds of pack_taps_noise_bf16: at most this many threads per block.
constexpr int PACK_MAX_BLOCK = 256;
// Largest hidden size of the fast path: unit indices within a row stay in 32-bit ints.
constexpr long long PACK_VEC_MAX_HIDDEN = 1LL << 30;

// ---- reduce.cu -------------------------------------------------------------------------------
// Blocks of the partial pass = entries of `partial` (one full wave on an H200), and threads per
// block of both kernels; the summation order, hence the bits, depend on both.
constexpr int SUMSQ_PARTS = 1024;
constexpr int SUMSQ_BLOCK = 256;
// ---- rope.cu ----------------------------------------------------------------------------------
// Warps per block of qk_norm_rope_bf16_hd*, and the heads of one row a warp takes together (its
// loads in flight at once, one sin/cos of the row's angles for all of them).
constexpr int QKR_WARPS = 8;
constexpr int QKR_HEADS = 8;

// ---- decode.cu -------------------------------------------------------------------------------
// attn_decode_mma: keys per K/V tile of one warp (two n8 tiles of S), and the most warps per CTA
// (each takes every W-th tile of the CTA's split, with its own two-stage cp.async buffers). Query
// heads per kv head: at most ATTN_WARP_ROWS (the M of the MMA).
constexpr int DEC_KEYS = 16;
constexpr int DEC_MMA_MAX_WARPS = 4;

// Threads per block of argmax_rows_* (one block per row).
constexpr int ARGMAX_BLOCK = 256;

// ---- rmsnorm.cu ------------------------------------------------------------------------------
// Threads per block, every rmsnorm kernel (the team math and the 8-warp block sum assume it).
constexpr int RMS_BLOCK = 256;
// Largest dim that uses warp teams; above it a whole block owns a row.
constexpr int RMS_WARP_TEAM_MAX_DIM = 1024;
// Floats of padding after each team's dw accumulator slab in the backward.
constexpr int RMS_SLAB_PAD = 4;
// Chunks of 8 a lane of a warp team owns (at most).
constexpr int RMS_CHUNKS_PER_LANE = 4;
// Recommended upper bound on the backward's part count.
constexpr int RMS_BWD_TARGET_PARTS = 1024;

// ---- hybrid.cu -------------------------------------------------------------------------------
// Threads per block of every hybrid.cu kernel (the row norms give each of its 8 warps a row).
constexpr int HYB_BLOCK = 256;
// causal_conv1d_silu: rows per item (one channel's run; its K - 1 earlier inputs are re-read
// once per run), and the largest kernel size its register window holds (Qwen3.5/3.6: 4).
constexpr int HYB_CONV_ROWS = 16;
constexpr int HYB_CONV_MAX_K = 8;
// gdn_conv_qkv_f32: window rows a lane holds (a step of P = WINDOW + 1 - K rows, at least 1, and
// the K - 1 before it: 4 rows a step at kernel size 4), and steps per item (a warp's run of rows).
constexpr int HYB_CONV_QKV_WINDOW = 7;
constexpr int HYB_CONV_QKV_STEPS = 8;
// rmsnorm1p_rope_partial: heads of one row a warp takes together (one sin/cos of the row's angles).
constexpr int HYB_NORM_ROPE_HEADS = 4;

// ---- gdn.cu ----------------------------------------------------------------------------------
// Tokens per chunk of the chunked gated delta rule (flash-linear-attention's chunk size; the Rust
// side's backend::GDN_CHUNK is the same number, checked by a test).
constexpr int GDN_CHUNK = 64;
// Threads per CTA of both delta-rule kernels: one per column of the [dk + dv] forward
// substitution at dk = dv = 128.
constexpr int GDN_THREADS = 256;
// Tensor-core kernel: f32 padding per shared-memory row (16 bytes: rows 4 banks apart, and the
// wmma 32-byte pointer alignment kept for 16-row tiles).
constexpr int GDN_TC_PAD = 4;
// Split chunked form (gdn_split_prep / gdn_split_state / gdn_split_out): value columns per
// CTA of the sequential state pass (4 CTAs per (sequence, head) at dv = 128) and its threads.
constexpr int GDN_SPLIT_BV = 32;
constexpr int GDN_SPLIT_STATE_THREADS = 128;
// Value columns per CTA of the output kernel (its 8 warps hold at most 2 of the 16 x 16 output
// tiles of a [GDN_CHUNK, 64] block each).
constexpr int GDN_SPLIT_OUT_BV = 64;
// Fast split form (gdn_fast_prep / gdn_fast_state / gdn_fast_out, bf16 scratch and operands):
// bf16 padding per shared-memory row (16 bytes: ldmatrix rows 4 banks apart), value columns per
// CTA of the state pass and its threads (one warp per 16 rows of a chunk), value columns per CTA
// of the output kernel and its threads (two warps per 16 rows of a chunk, half the columns each:
// at dv = 128 one CTA per (chunk, head), so q and k are staged once and Q K^T taken once per pair).
constexpr int GDN_FAST_PAD = 8;
constexpr int GDN_FAST_BV = 32;
constexpr int GDN_FAST_STATE_THREADS = 128;
// CTAs per SM the state pass is compiled for (its register cap: 65536 / (128 * 3) = 170): its W
// and Ke^T operands live in registers and its shared memory is ~26 KB, so registers decide.
constexpr int GDN_FAST_STATE_CTAS = 3;
constexpr int GDN_FAST_OUT_BV = 128;
constexpr int GDN_FAST_OUT_THREADS = 256;
