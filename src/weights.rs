//! Weights on disk: Hugging Face checkpoint folders (`config.json` + `model.safetensors`, or
//! `model.safetensors.index.json` + shards) memory-mapped with memmap2; the HF Qwen3 tensor names
//! and shapes, in one place; crash-safe (atomic) writers; and the random-init target writer behind
//! `dflash-engine init-model`.
//!
//! Every failure a user can cause (a wrong path, a half-downloaded shard, a checkpoint that does
//! not match its config) is a typed [`WeightsError`] whose message says which file, which tensor
//! and what to do; nothing here panics on bad input.

use crate::config::{Arch, ConfigError, DrafterConfig, HybridConfig, LayerDims, LayerType, TargetConfig};
use crate::rng;
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Standard deviation of random linear and embedding weights (DFLASH.md section 3).
pub const DEFAULT_INIT_STD: f32 = 0.02;

/// The safetensors crate refuses headers above 100 MB; a bigger length means "not safetensors".
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes generated per hand-off to the writer thread during `init_target`: large enough that
/// rayon's per-chunk fan-out is noise, small enough that a few in flight cost little memory.
const INIT_CHUNK_BYTES: usize = 64 << 20;

/// Chunks that may wait for the disk while the next one is generated (bounds init memory to
/// about `(INIT_QUEUE_DEPTH + 2) * INIT_CHUNK_BYTES`).
const INIT_QUEUE_DEPTH: usize = 2;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(
        "{} does not exist. A model folder needs config.json plus model.safetensors (or \
         model.safetensors.index.json and its shards), as a Hugging Face checkpoint has; to make \
         a random target, run `dflash-engine init-model`",
        .path.display()
    )]
    MissingFile { path: PathBuf },
    #[error("cannot {op} {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{} is not a valid safetensors file: {reason}", .path.display())]
    MalformedHeader { path: PathBuf, reason: String },
    #[error("{} is not a valid shard index: {reason}", .path.display())]
    MalformedIndex { path: PathBuf, reason: String },
    #[error(
        "{} is truncated: its header says it needs {needed} bytes but the file has {actual} \
         (an interrupted download or copy?); download or create it again",
        .path.display()
    )]
    Truncated { path: PathBuf, needed: u64, actual: u64 },
    #[error(
        "tensor `{name}`{} not found in {}{}",
        fmt_expected(.expected),
        fmt_paths(.searched),
        fmt_suggestions(.suggestions)
    )]
    MissingTensor { name: String, expected: Option<Vec<usize>>, searched: Vec<PathBuf>, suggestions: Vec<String> },
    #[error(
        "cannot tell where the text model's tensors are in {}: {reason}. A Hugging Face checkpoint \
         has `model.embed_tokens.weight` (text-only) or `model.language_model.embed_tokens.weight` \
         (vision-language) beside the matching `norm.weight`",
        fmt_paths(.searched)
    )]
    NoTextModel { searched: Vec<PathBuf>, reason: String },
    #[error(
        "tensor `{name}` in {} has shape {found:?}, but {expected:?} was expected from the \
         config; the weights do not match config.json",
        .file.display()
    )]
    WrongShape { name: String, file: PathBuf, expected: Vec<usize>, found: Vec<usize> },
    #[error(
        "tensor `{name}` in {} has dtype {dtype}; only BF16, F16 and F32 weights are supported \
         (quantised checkpoints are not)",
        .file.display()
    )]
    UnsupportedDtype { name: String, file: PathBuf, dtype: Dtype },
    #[error("invalid argument: {0}")]
    InvalidInput(String),
}

pub type Result<T, E = WeightsError> = std::result::Result<T, E>;

fn fmt_paths(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}

fn fmt_expected(shape: &Option<Vec<usize>>) -> String {
    match shape {
        Some(s) => format!(" (expected shape {s:?} from config.json)"),
        None => String::new(),
    }
}

fn fmt_suggestions(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!("; similar names present: {}", names.join(", "))
    }
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> WeightsError + 'a {
    move |source| {
        if source.kind() == std::io::ErrorKind::NotFound && op == "open" {
            WeightsError::MissingFile { path: path.to_path_buf() }
        } else {
            WeightsError::Io { path: path.to_path_buf(), op, source }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor names and shapes
// ---------------------------------------------------------------------------------------------

/// Hugging Face Qwen3 tensor names (target) and the public DFlash drafter names, defined once.
pub mod names {
    use super::LayerTensor;

    pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
    pub const FINAL_NORM: &str = "model.norm.weight";
    /// Absent when `tie_word_embeddings` is true: the head is then `EMBED_TOKENS`.
    pub const LM_HEAD: &str = "lm_head.weight";

    /// `model.layers.{i}.<suffix>` of the target.
    pub fn target_layer(i: usize, t: LayerTensor) -> String {
        target_layer_part(i, t.suffix())
    }

    /// `model.layers.{i}.{suffix}`, for any suffix.
    pub fn target_layer_part(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }

    /// Drafter checkpoints use the public DFlash layout: no `model.` prefix, plus fc and
    /// hidden_norm (embedding and lm_head are the target's and are not stored).
    pub const DRAFTER_FC: &str = "fc.weight";
    pub const DRAFTER_HIDDEN_NORM: &str = "hidden_norm.weight";
    pub const DRAFTER_FINAL_NORM: &str = "norm.weight";

    /// `layers.{i}.<suffix>` of the drafter.
    pub fn drafter_layer(i: usize, t: LayerTensor) -> String {
        format!("layers.{i}.{}", t.suffix())
    }
}

/// The tensors of one Qwen3 decoder layer, in the order the init streams number them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    InputLayernorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    PostAttentionLayernorm,
    GateProj,
    UpProj,
    DownProj,
}

impl LayerTensor {
    pub const ALL: [LayerTensor; 11] = [
        LayerTensor::InputLayernorm,
        LayerTensor::QProj,
        LayerTensor::KProj,
        LayerTensor::VProj,
        LayerTensor::OProj,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
        LayerTensor::PostAttentionLayernorm,
        LayerTensor::GateProj,
        LayerTensor::UpProj,
        LayerTensor::DownProj,
    ];

    pub fn suffix(self) -> &'static str {
        match self {
            LayerTensor::InputLayernorm => "input_layernorm.weight",
            LayerTensor::QProj => "self_attn.q_proj.weight",
            LayerTensor::KProj => "self_attn.k_proj.weight",
            LayerTensor::VProj => "self_attn.v_proj.weight",
            LayerTensor::OProj => "self_attn.o_proj.weight",
            LayerTensor::QNorm => "self_attn.q_norm.weight",
            LayerTensor::KNorm => "self_attn.k_norm.weight",
            LayerTensor::PostAttentionLayernorm => "post_attention_layernorm.weight",
            LayerTensor::GateProj => "mlp.gate_proj.weight",
            LayerTensor::UpProj => "mlp.up_proj.weight",
            LayerTensor::DownProj => "mlp.down_proj.weight",
        }
    }

    /// PyTorch `nn.Linear` layout `[out, in]`: `y = x W^T`.
    pub fn shape(self, d: &LayerDims) -> Vec<usize> {
        let (h, i) = (d.hidden_size, d.intermediate_size);
        match self {
            LayerTensor::InputLayernorm | LayerTensor::PostAttentionLayernorm => vec![h],
            LayerTensor::QNorm | LayerTensor::KNorm => vec![d.head_dim],
            LayerTensor::QProj => vec![d.q_dim(), h],
            LayerTensor::KProj | LayerTensor::VProj => vec![d.kv_dim(), h],
            LayerTensor::OProj => vec![h, d.q_dim()],
            LayerTensor::GateProj | LayerTensor::UpProj => vec![i, h],
            LayerTensor::DownProj => vec![h, i],
        }
    }

    pub fn role(self) -> TensorRole {
        match self {
            LayerTensor::InputLayernorm
            | LayerTensor::PostAttentionLayernorm
            | LayerTensor::QNorm
            | LayerTensor::KNorm => TensorRole::Norm,
            _ => TensorRole::Linear,
        }
    }
}

/// The tensors of one Qwen3.5/3.6 hybrid decoder layer (QWEN35.md section 1): the shared norms
/// and MLP, plus the gated full attention or the Gated DeltaNet, whichever the layer's type is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HybridTensor {
    InputLayernorm,
    PostAttentionLayernorm,
    GateProj,
    UpProj,
    DownProj,
    // Gated full attention.
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    // Gated DeltaNet.
    InProjQkv,
    InProjZ,
    InProjB,
    InProjA,
    Conv1d,
    ALog,
    DtBias,
    GatedNorm,
    OutProj,
}

impl HybridTensor {
    /// A layer's tensors in file (and init-stream) order.
    pub fn of_layer(kind: LayerType) -> &'static [HybridTensor] {
        use HybridTensor::*;
        match kind {
            LayerType::Full => &[
                InputLayernorm,
                QProj,
                KProj,
                VProj,
                OProj,
                QNorm,
                KNorm,
                PostAttentionLayernorm,
                GateProj,
                UpProj,
                DownProj,
            ],
            LayerType::Linear => &[
                InputLayernorm,
                InProjQkv,
                InProjZ,
                InProjB,
                InProjA,
                Conv1d,
                ALog,
                DtBias,
                GatedNorm,
                OutProj,
                PostAttentionLayernorm,
                GateProj,
                UpProj,
                DownProj,
            ],
        }
    }

    pub fn suffix(self) -> &'static str {
        use HybridTensor::*;
        match self {
            InputLayernorm => "input_layernorm.weight",
            PostAttentionLayernorm => "post_attention_layernorm.weight",
            GateProj => "mlp.gate_proj.weight",
            UpProj => "mlp.up_proj.weight",
            DownProj => "mlp.down_proj.weight",
            QProj => "self_attn.q_proj.weight",
            KProj => "self_attn.k_proj.weight",
            VProj => "self_attn.v_proj.weight",
            OProj => "self_attn.o_proj.weight",
            QNorm => "self_attn.q_norm.weight",
            KNorm => "self_attn.k_norm.weight",
            InProjQkv => "linear_attn.in_proj_qkv.weight",
            InProjZ => "linear_attn.in_proj_z.weight",
            InProjB => "linear_attn.in_proj_b.weight",
            InProjA => "linear_attn.in_proj_a.weight",
            Conv1d => "linear_attn.conv1d.weight",
            ALog => "linear_attn.A_log",
            DtBias => "linear_attn.dt_bias",
            GatedNorm => "linear_attn.norm.weight",
            OutProj => "linear_attn.out_proj.weight",
        }
    }

    /// Shapes as transformers stores them (`nn.Linear` `[out, in]`, `nn.Conv1d` `[C, 1, K]`).
    pub fn shape(self, d: &LayerDims, hy: &HybridConfig) -> Vec<usize> {
        use HybridTensor::*;
        let (h, i) = (d.hidden_size, d.intermediate_size);
        let hv = hy.linear_num_value_heads;
        match self {
            InputLayernorm | PostAttentionLayernorm => vec![h],
            GateProj | UpProj => vec![i, h],
            DownProj => vec![h, i],
            // Per head: the query's head_dim rows, then the gate's.
            QProj => vec![2 * d.q_dim(), h],
            KProj | VProj => vec![d.kv_dim(), h],
            OProj => vec![h, d.q_dim()],
            QNorm | KNorm => vec![d.head_dim],
            InProjQkv => vec![hy.conv_dim(), h],
            InProjZ => vec![hy.value_dim(), h],
            InProjB | InProjA => vec![hv, h],
            Conv1d => vec![hy.conv_dim(), 1, hy.linear_conv_kernel_dim],
            ALog | DtBias => vec![hv],
            GatedNorm => vec![hy.linear_value_head_dim],
            OutProj => vec![h, hy.value_dim()],
        }
    }

    pub fn role(self, hy: &HybridConfig) -> TensorRole {
        use HybridTensor::*;
        match self {
            InputLayernorm | PostAttentionLayernorm | QNorm | KNorm => TensorRole::NormOffset,
            GatedNorm => TensorRole::Norm,
            Conv1d => TensorRole::Conv { kernel: hy.linear_conv_kernel_dim },
            ALog => TensorRole::ALog,
            DtBias => TensorRole::DtBias,
            _ => TensorRole::Linear,
        }
    }
}

/// What a tensor is, which decides its random init (see [`init_value_bf16`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// ~ N(0, std).
    Embedding,
    /// ~ N(0, std).
    Linear,
    /// ~ N(0, gain * std): a hybrid target's embedding and lm_head (see [`HYBRID_EMBED_GAIN`]).
    Scaled { gain: u32 },
    /// A plain-`w` norm: 1.
    Norm,
    /// A `1 + w` norm (Qwen3.5/3.6): `w` ~ N(0, std), near 0 like transformers' zero init but not
    /// exactly 0, so a forward that ignores `w` is caught by a comparison.
    NormOffset,
    /// A depthwise causal convolution's kernel: ~ N(0, 1 / (3 * kernel)), the variance of
    /// PyTorch's default `Conv1d` init (uniform within +-1/sqrt(fan_in), fan_in = kernel).
    Conv { kernel: usize },
    /// Gated DeltaNet `A_log = ln(A)`, `A ~ U(0.01, 16)` as transformers initialises it.
    ALog,
    /// Gated DeltaNet `dt_bias`: 1, as transformers initialises it.
    DtBias,
}

/// One expected tensor: its name, shape and role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

impl TensorSpec {
    fn new(name: impl Into<String>, shape: Vec<usize>, role: TensorRole) -> Self {
        Self { name: name.into(), shape, role }
    }

    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// A hybrid (Qwen3.5/3.6) target's random embedding is this many times `init_std`, so that its
/// random-weight presets behave like the Qwen3 ones at the same `init_std`: greedy continuations
/// that are mostly a function of the last token or two (chains, cycles and repeats a drafter can
/// learn) rather than of the whole recent context.
///
/// Every layer reads the residual stream through an RMSNorm, so a layer's output has the same
/// size whatever the embedding's, and what the greedy token depends on is set by the ratio of the
/// embedding to what the layers add. In a Qwen3 layer every branch shrinks with `init_std`
/// (attention averages `v` over the context, the MLP multiplies two small projections), so at
/// 0.05 the current token's embedding dominates. A Gated DeltaNet layer ends in a gated RMSNorm
/// that rescales its output to unit RMS before `out_proj`: its contribution stays as large as
/// the embedding at 0.05 and depends on the last few tokens, and greedy continuations look
/// random (measured on qwen3.5-tiny: the previous token predicts 9% of the next, against 57% for
/// the Qwen3 tiny preset). An embedding 16x larger, with the layers unchanged, brings that back
/// to 88%, with the layers still adding context; shrinking every weight instead (0.003) makes the
/// continuations a pure function of the token but also flattens the lm_head's logits.
pub const HYBRID_EMBED_GAIN: u32 = 16;

/// A hybrid target's random lm_head is this many times `init_std`: its logits have a standard
/// deviation of `4 * 0.05 * sqrt(64) = 1.6` on qwen3.5-tiny (0.4 for the Qwen3 tiny preset), so
/// the target's next-token distributions are peaked like a trained model's and a drafter that
/// predicts the right token lowers its loss well below the first step's (measured: `run
/// --target qwen3.5-tiny` goes from 7.1 to 2.8 in 300 steps; with the lm_head at 1x, from 5.7 to
/// 3.8). The greedy token does not depend on this scale.
pub const HYBRID_LM_HEAD_GAIN: u32 = 4;

/// Every tensor of a target, in file order: embedding, layers 0..L (in [`LayerTensor::ALL`] order
/// for Qwen3, [`HybridTensor::of_layer`] for a hybrid), final norm, then `lm_head` unless tied.
/// The position in this list is the tensor's random-init stream ([`init_normal`]); a hybrid's
/// embedding and lm_head are [`TensorRole::Scaled`] ([`HYBRID_EMBED_GAIN`],
/// [`HYBRID_LM_HEAD_GAIN`]).
///
/// Names are the text-only layout's (`model.` prefix); [`ModelFiles`] maps them onto a
/// vision-language checkpoint's `model.language_model.` prefix.
pub fn target_tensor_specs(cfg: &TargetConfig) -> Vec<TensorSpec> {
    let d = cfg.layer_dims();
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let (embed, head) = match &cfg.arch {
        Arch::Qwen3 => (TensorRole::Embedding, TensorRole::Linear),
        Arch::Qwen35(_) => {
            (TensorRole::Scaled { gain: HYBRID_EMBED_GAIN }, TensorRole::Scaled { gain: HYBRID_LM_HEAD_GAIN })
        }
    };
    let mut specs = vec![TensorSpec::new(names::EMBED_TOKENS, vec![v, h], embed)];
    let final_norm = match &cfg.arch {
        Arch::Qwen3 => {
            for i in 0..cfg.num_hidden_layers {
                for t in LayerTensor::ALL {
                    specs.push(TensorSpec::new(names::target_layer(i, t), t.shape(&d), t.role()));
                }
            }
            TensorRole::Norm
        }
        Arch::Qwen35(hy) => {
            for i in 0..cfg.num_hidden_layers {
                specs.extend(hybrid_layer_specs(i, &d, hy));
            }
            TensorRole::NormOffset
        }
    };
    specs.push(TensorSpec::new(names::FINAL_NORM, vec![h], final_norm));
    if !cfg.tie_word_embeddings {
        specs.push(TensorSpec::new(names::LM_HEAD, vec![v, h], head));
    }
    specs
}

/// The tensors of hybrid layer `i` (its type from `hy.layer_types[i]`), in file order.
pub fn hybrid_layer_specs(i: usize, d: &LayerDims, hy: &HybridConfig) -> Vec<TensorSpec> {
    HybridTensor::of_layer(hy.layer_types[i])
        .iter()
        .map(|&t| TensorSpec::new(names::target_layer_part(i, t.suffix()), t.shape(d, hy), t.role(hy)))
        .collect()
}

/// Every trained tensor of a drafter, in checkpoint order: fc `[H, K*H]`, hidden_norm, layers,
/// final norm. The position in this list is a natural init stream id for the drafter too.
pub fn drafter_tensor_specs(cfg: &DrafterConfig) -> Vec<TensorSpec> {
    let d = cfg.layer_dims();
    let h = cfg.hidden_size;
    let mut specs = vec![
        TensorSpec::new(names::DRAFTER_FC, vec![h, cfg.num_taps() * h], TensorRole::Linear),
        TensorSpec::new(names::DRAFTER_HIDDEN_NORM, vec![h], TensorRole::Norm),
    ];
    for i in 0..cfg.num_layers {
        for t in LayerTensor::ALL {
            specs.push(TensorSpec::new(names::drafter_layer(i, t), t.shape(&d), t.role()));
        }
    }
    specs.push(TensorSpec::new(names::DRAFTER_FINAL_NORM, vec![h], TensorRole::Norm));
    specs
}

// ---------------------------------------------------------------------------------------------
// Reading: memory-mapped safetensors files
// ---------------------------------------------------------------------------------------------

/// Name, dtype, shape and file of a stored tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub file: PathBuf,
}

/// A stored tensor's raw little-endian bytes, borrowed from the memory map (for uploads that
/// keep the on-disk dtype, e.g. bf16 straight to the GPU). Not necessarily aligned.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard's map (header already skipped).
    start: usize,
    end: usize,
}

/// The tensors of one or more safetensors files, memory-mapped, with no model config attached
/// (drafter checkpoints use this directly; targets go through [`ModelFiles`]).
pub struct TensorStore {
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
}

impl TensorStore {
    /// Opens `dir/model.safetensors`, or else the shards named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(WeightsError::MissingFile { path: dir.to_path_buf() });
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::open_files(&[single]);
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(&index);
        }
        Err(WeightsError::MissingFile { path: single })
    }

    /// Opens one safetensors file.
    pub fn open_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_files(&[path.as_ref().to_path_buf()])
    }

    fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut store = TensorStore { shards: Vec::new(), entries: HashMap::new() };
        for path in paths {
            let (mmap, metadata, data_start) = map_safetensors(path)?;
            let shard = store.shards.len();
            for (name, info) in metadata.tensors() {
                let entry = Entry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0,
                    end: data_start + info.data_offsets.1,
                };
                if let Some(prev) = store.entries.insert(name.clone(), entry) {
                    return Err(WeightsError::MalformedIndex {
                        path: path.clone(),
                        reason: format!(
                            "tensor `{name}` is stored both here and in {}",
                            store.shards[prev.shard].path.display()
                        ),
                    });
                }
            }
            store.shards.push(Shard { path: path.clone(), mmap });
        }
        Ok(store)
    }

    /// HF sharded layout: `{"metadata": {...}, "weight_map": {"tensor name": "shard file"}}`.
    fn open_index(index: &Path) -> Result<Self> {
        let malformed = |reason: String| WeightsError::MalformedIndex { path: index.to_path_buf(), reason };
        let text = std::fs::read_to_string(index).map_err(io_err(index, "read"))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| malformed(format!("not JSON ({e})")))?;
        let Some(Value::Object(weight_map)) = value.get("weight_map") else {
            return Err(malformed("no `weight_map` object (tensor name -> shard file)".into()));
        };
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shard_names = BTreeSet::new();
        for (name, file) in weight_map {
            let Some(file) = file.as_str() else {
                return Err(malformed(format!("weight_map[`{name}`] is not a file name")));
            };
            // Shards must sit beside the index; refuse paths that would escape the folder.
            let p = Path::new(file);
            if p.components().count() != 1 || p.is_absolute() || file == ".." {
                return Err(malformed(format!("shard name `{file}` is not a plain file name")));
            }
            shard_names.insert(file);
        }
        if shard_names.is_empty() {
            return Err(malformed("weight_map is empty".into()));
        }
        let paths: Vec<PathBuf> = shard_names.iter().map(|f| dir.join(f)).collect();
        let store = Self::open_files(&paths)?;
        for (name, file) in weight_map {
            let want = dir.join(file.as_str().unwrap_or_default());
            match store.entries.get(name) {
                Some(e) if store.shards[e.shard].path == want => {}
                Some(e) => {
                    return Err(malformed(format!(
                        "weight_map puts `{name}` in {}, but it is in {}",
                        want.display(),
                        store.shards[e.shard].path.display()
                    )))
                }
                None => {
                    return Err(malformed(format!(
                        "weight_map lists `{name}` in {}, but that shard does not contain it",
                        want.display()
                    )))
                }
            }
        }
        Ok(store)
    }

    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// The files this store maps, in load order.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| WeightsError::MissingTensor {
            name: name.to_string(),
            expected: None,
            searched: self.shards.iter().map(|s| s.path.clone()).collect(),
            suggestions: near_names(name, self.entries.keys().map(String::as_str)),
        })
    }

    pub fn tensor_info(&self, name: &str) -> Result<TensorMeta> {
        let e = self.entry(name)?;
        Ok(TensorMeta {
            name: name.to_string(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            file: self.shards[e.shard].path.clone(),
        })
    }

    pub fn tensor_bytes(&self, name: &str) -> Result<RawTensor<'_>> {
        let e = self.entry(name)?;
        Ok(RawTensor { dtype: e.dtype, shape: &e.shape, bytes: &self.shards[e.shard].mmap[e.start..e.end] })
    }

    /// Checks that `name` exists with exactly `expected_shape` and a float dtype we convert.
    pub fn check(&self, name: &str, expected_shape: &[usize]) -> Result<()> {
        let e = self.entry(name).map_err(|err| match err {
            WeightsError::MissingTensor { name, searched, suggestions, .. } => {
                WeightsError::MissingTensor { name, expected: Some(expected_shape.to_vec()), searched, suggestions }
            }
            other => other,
        })?;
        let file = || self.shards[e.shard].path.clone();
        if e.shape != expected_shape {
            return Err(WeightsError::WrongShape {
                name: name.to_string(),
                file: file(),
                expected: expected_shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        if !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(WeightsError::UnsupportedDtype { name: name.to_string(), file: file(), dtype: e.dtype });
        }
        Ok(())
    }

    /// The tensor converted to f32 (exact for BF16, F16 and F32), after checking its shape.
    pub fn tensor_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>> {
        self.check(name, expected_shape)?;
        let raw = self.tensor_bytes(name)?;
        Ok(to_f32(raw.dtype, raw.bytes))
    }
}

/// Little-endian BF16/F16/F32 bytes to f32; every conversion is exact. Callers check the dtype.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    const PER_TASK: usize = 1 << 16;
    let width = if dtype == Dtype::F32 { 4 } else { 2 };
    let mut out = vec![0f32; bytes.len() / width];
    out.par_chunks_mut(PER_TASK).zip(bytes.par_chunks(PER_TASK * width)).for_each(|(dst, src)| {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(width)) {
            *d = match dtype {
                Dtype::BF16 => bf16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32(),
                Dtype::F16 => f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32(),
                _ => f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
            };
        }
    });
    out
}

/// Maps a safetensors file and parses its header, checking every length against the file size
/// before any tensor byte is read. Returns the map, the header and where tensor data starts.
fn map_safetensors(path: &Path) -> Result<(Mmap, Metadata, usize)> {
    let file = File::open(path).map_err(io_err(path, "open"))?;
    let actual = file.metadata().map_err(io_err(path, "stat"))?.len();
    if actual < 8 {
        return Err(WeightsError::Truncated { path: path.to_path_buf(), needed: 8, actual });
    }
    // SAFETY: the map is read-only and lives as long as the store. Safety rests on nobody
    // truncating or rewriting the file while it is mapped (that would be SIGBUS or torn reads);
    // our writers never modify a file in place, they write a temp file and rename it over.
    let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path, "memory-map"))?;
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&mmap[..8]);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(WeightsError::MalformedHeader {
            path: path.to_path_buf(),
            reason: format!("the header length field says {header_len} bytes (over 100 MB): not a safetensors file"),
        });
    }
    let header_end = 8 + header_len;
    if header_end > actual {
        return Err(WeightsError::Truncated { path: path.to_path_buf(), needed: header_end, actual });
    }
    match SafeTensors::read_metadata(&mmap) {
        Ok((n, metadata)) => Ok((mmap, metadata, 8 + n)),
        Err(SafeTensorError::MetadataIncompleteBuffer) => {
            // The header parsed but the data region does not end at the end of the file: find
            // out whether bytes are missing (truncation) or extra.
            let header = &mmap[8..header_end as usize];
            let metadata: Metadata = serde_json::from_slice(header)
                .map_err(|e| WeightsError::MalformedHeader { path: path.to_path_buf(), reason: e.to_string() })?;
            let needed = header_end + metadata.data_len() as u64;
            if needed > actual {
                Err(WeightsError::Truncated { path: path.to_path_buf(), needed, actual })
            } else {
                Err(WeightsError::MalformedHeader {
                    path: path.to_path_buf(),
                    reason: format!("{} unexpected bytes after the last tensor", actual - needed),
                })
            }
        }
        Err(e) => Err(WeightsError::MalformedHeader { path: path.to_path_buf(), reason: e.to_string() }),
    }
}

/// Up to three stored names close to `name`: same text up to a prefix (a `model.` too many or
/// too few), or within a small edit distance.
fn near_names<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Vec<String> {
    let limit = (name.len() / 4).max(2);
    let mut scored: Vec<(usize, &str)> = candidates
        .filter_map(|c| {
            let d = if c.ends_with(name) || name.ends_with(c) { 1 } else { edit_distance(name, c) };
            (d <= limit).then_some((d, c))
        })
        .collect();
    scored.sort_unstable();
    scored.into_iter().take(3).map(|(_, c)| c.to_string()).collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        cur[0] = i;
        for j in 1..=b.len() {
            let sub = prev[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            cur[j] = sub.min(prev[j] + 1).min(cur[j - 1] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// A target checkpoint folder: its validated `config.json` and its memory-mapped tensors, with
/// every tensor the config implies checked for presence, shape and dtype at open.
///
/// Tensors are asked for by their text-only names (`model.…`, `lm_head.weight`). Where the text
/// model's tensors really live is found by probing the stored names: `model.` in text-only
/// checkpoints, `model.language_model.` in vision-language ones. Tensors the target does not use
/// (`model.visual.*`, the `mtp.*` head) are never read.
pub struct ModelFiles {
    dir: PathBuf,
    config: TargetConfig,
    tensors: TensorStore,
    /// What replaces `model.` in a text-only name to give the stored name.
    prefix: String,
}

/// The prefix the text-only layout uses for the text model's tensors.
const TEXT_PREFIX: &str = "model.";

impl ModelFiles {
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(WeightsError::MissingFile { path: dir.to_path_buf() });
        }
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(WeightsError::MissingFile { path: config_path });
        }
        let config = TargetConfig::from_file(&config_path)?;
        let tensors = TensorStore::open_dir(dir)?;
        let prefix = probe_text_prefix(&tensors)?;
        let files = ModelFiles { dir: dir.to_path_buf(), config, tensors, prefix };
        files.check_target_tensors()?;
        Ok(files)
    }

    /// Every tensor of [`target_tensor_specs`] is present with its shape and a supported dtype.
    pub fn check_target_tensors(&self) -> Result<()> {
        for spec in target_tensor_specs(&self.config) {
            self.tensors.check(&self.stored_name(&spec.name), &spec.shape)?;
        }
        Ok(())
    }

    /// The stored name of a tensor asked for by its text-only name.
    pub fn stored_name(&self, name: &str) -> String {
        match name.strip_prefix(TEXT_PREFIX) {
            Some(rest) => format!("{}{rest}", self.prefix),
            None => name.to_string(),
        }
    }

    /// Where the text model's tensors are: `model.` or `model.language_model.`.
    pub fn text_prefix(&self) -> &str {
        &self.prefix
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    pub fn tensors(&self) -> &TensorStore {
        &self.tensors
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.has(&self.stored_name(name))
    }

    pub fn tensor_info(&self, name: &str) -> Result<TensorMeta> {
        self.tensors.tensor_info(&self.stored_name(name))
    }

    pub fn tensor_bytes(&self, name: &str) -> Result<RawTensor<'_>> {
        self.tensors.tensor_bytes(&self.stored_name(name))
    }

    /// One tensor converted to f32 after checking its shape. Loading converts tensor by tensor,
    /// so the host never holds an f32 copy of the whole model.
    pub fn tensor_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>> {
        self.tensors.tensor_f32(&self.stored_name(name), expected_shape)
    }

    /// The tensor that acts as lm_head `[V, H]`: `lm_head.weight`, or the embedding when the
    /// config ties them and the checkpoint (as usual) omits the head.
    pub fn lm_head_name(&self) -> &'static str {
        if self.config.tie_word_embeddings && !self.has(names::LM_HEAD) {
            names::EMBED_TOKENS
        } else {
            names::LM_HEAD
        }
    }
}

/// Finds the text model's prefix from the stored names: a `…embed_tokens.weight` with a
/// `…norm.weight` beside it, outside the vision tower and the multi-token-prediction head.
fn probe_text_prefix(store: &TensorStore) -> Result<String> {
    const EMBED: &str = "embed_tokens.weight";
    let mut found: Vec<&str> = store
        .entries
        .keys()
        .filter_map(|n| n.strip_suffix(EMBED))
        .filter(|p| p.starts_with(TEXT_PREFIX) && p.ends_with('.') && !p.contains("visual."))
        .filter(|p| store.has(&format!("{p}norm.weight")))
        .collect();
    found.sort_unstable();
    let searched = || store.shards.iter().map(|s| s.path.clone()).collect();
    match found.as_slice() {
        [one] => Ok(one.to_string()),
        [] => Err(WeightsError::NoTextModel {
            searched: searched(),
            reason: "no `model.…embed_tokens.weight` with a `norm.weight` beside it".into(),
        }),
        many => Err(WeightsError::NoTextModel {
            searched: searched(),
            reason: format!("several candidates ({}) ", many.join(", ")),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Writing: atomic files and the safetensors format
// ---------------------------------------------------------------------------------------------

/// Writes through `body` into `path.tmp-<pid>` beside `path`, fsyncs it, renames it over `path`
/// and fsyncs the directory: after a crash `path` is either the old file or the complete new
/// one, never a torn mix. The temp file is removed on failure.
fn write_atomic(path: &Path, body: impl FnOnce(&mut BufWriter<File>) -> Result<()>) -> Result<()> {
    let Some(file_name) = path.file_name() else {
        return Err(WeightsError::InvalidInput(format!("{} is not a file path", path.display())));
    };
    let tmp = path.with_file_name(format!("{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let file = File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        body(&mut w)?;
        let file = w.into_inner().map_err(|e| io_err(&tmp, "write")(e.into_error()))?;
        file.sync_all().map_err(io_err(&tmp, "fsync"))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(io_err(path, "rename a temp file onto"))?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        // The rename is durable only once the directory entry is.
        File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "fsync directory"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp); // best effort: it may not exist
    }
    result
}

/// Writes `bytes` (e.g. a config.json) to `path` with the same protocol as the weights.
pub fn write_file_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let path = path.as_ref();
    write_atomic(path, |w| w.write_all(bytes).map_err(io_err(path, "write")))
}

fn tensor_nbytes(name: &str, dtype: Dtype, shape: &[usize]) -> Result<u64> {
    let bits = shape
        .iter()
        .try_fold(dtype.bitsize() as u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| WeightsError::InvalidInput(format!("tensor `{name}`: shape {shape:?} overflows")))?;
    if bits % 8 != 0 {
        return Err(WeightsError::InvalidInput(format!(
            "tensor `{name}`: {dtype} x {shape:?} is not a whole number of bytes"
        )));
    }
    Ok(bits / 8)
}

/// The complete safetensors preamble: 8-byte little-endian header length, then the JSON header
/// (tensor entries with `data_offsets` in the given order, plus `__metadata__`) padded with
/// spaces so tensor data starts 8-byte aligned. `"format": "pt"` is added to the metadata unless
/// present, because transformers refuses safetensors files whose format is not a framework it knows.
fn safetensors_header(
    tensors: &[(&str, Dtype, &[usize])],
    metadata: Option<&HashMap<String, String>>,
) -> Result<(Vec<u8>, u64)> {
    let mut header = Map::new();
    let mut meta: Map<String, Value> =
        metadata.into_iter().flatten().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    meta.entry("format").or_insert_with(|| json!("pt"));
    header.insert("__metadata__".to_string(), Value::Object(meta));
    let mut offset = 0u64;
    for &(name, dtype, shape) in tensors {
        if name == "__metadata__" {
            return Err(WeightsError::InvalidInput("`__metadata__` is reserved and cannot name a tensor".into()));
        }
        let end = offset + tensor_nbytes(name, dtype, shape)?;
        let entry = json!({"dtype": dtype.to_string(), "shape": shape, "data_offsets": [offset, end]});
        if header.insert(name.to_string(), entry).is_some() {
            return Err(WeightsError::InvalidInput(format!("tensor `{name}` is listed twice")));
        }
        offset = end;
    }
    let mut json_bytes = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| WeightsError::InvalidInput(format!("cannot serialise the header: {e}")))?;
    while json_bytes.len() % 8 != 0 {
        json_bytes.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json_bytes.len());
    out.extend_from_slice(&(json_bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&json_bytes);
    Ok((out, offset))
}

/// Writes a safetensors file atomically (see [`write_file_atomic`]). Tensors are
/// `(name, dtype, shape, little-endian bytes)`, stored in the given order.
pub fn write_safetensors_atomic(
    path: impl AsRef<Path>,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    for (name, dtype, shape, bytes) in tensors {
        let want = tensor_nbytes(name, *dtype, shape)?;
        if bytes.len() as u64 != want {
            return Err(WeightsError::InvalidInput(format!(
                "tensor `{name}`: {dtype} x {shape:?} needs {want} bytes, {} were given",
                bytes.len()
            )));
        }
    }
    let layout: Vec<(&str, Dtype, &[usize])> =
        tensors.iter().map(|(n, d, s, _)| (n.as_str(), *d, s.as_slice())).collect();
    let (header, _) = safetensors_header(&layout, metadata.as_ref())?;
    write_atomic(path, |w| {
        w.write_all(&header).map_err(io_err(path, "write"))?;
        for (_, _, _, bytes) in tensors {
            w.write_all(bytes).map_err(io_err(path, "write"))?;
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Random initialisation
// ---------------------------------------------------------------------------------------------

/// The `elem`-th standard normal of the stream `rng::Philox::new(seed, [stream, domain::INIT])`
/// (the value its `elem+1`-th `.normal()` call returns), computed directly from the counter so
/// that any chunking and any thread count give the same value. `Philox::normal` uses exactly one
/// Philox block (four words: two 53-bit uniforms for Box-Muller) per draw, so draw `e` is block
/// `e`; `init_normal_matches_the_sequential_stream` pins the equivalence.
#[inline]
pub fn init_normal(seed: u64, stream: u32, elem: u64) -> f64 {
    const TWO_POW_M53: f64 = 1.0 / 9_007_199_254_740_992.0;
    let key = [seed as u32, (seed >> 32) as u32];
    let w = rng::philox4x32_10([elem as u32, (elem >> 32) as u32, stream, rng::domain::INIT], key);
    let a = ((u64::from(w[0]) << 32) | u64::from(w[1])) >> 11;
    let b = ((u64::from(w[2]) << 32) | u64::from(w[3])) >> 11;
    let u1 = 1.0 - a as f64 * TWO_POW_M53; // (0, 1]: ln is finite
    let u2 = b as f64 * TWO_POW_M53;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A uniform in (0, 1] from the same counter as [`init_normal`] (its first 53-bit word).
#[inline]
fn init_uniform(seed: u64, stream: u32, elem: u64) -> f64 {
    const TWO_POW_M53: f64 = 1.0 / 9_007_199_254_740_992.0;
    let key = [seed as u32, (seed >> 32) as u32];
    let w = rng::philox4x32_10([elem as u32, (elem >> 32) as u32, stream, rng::domain::INIT], key);
    1.0 - (((u64::from(w[0]) << 32) | u64::from(w[1])) >> 11) as f64 * TWO_POW_M53
}

/// The stored bf16 value of element `elem` of a randomly initialised tensor:
/// `bf16(f32(std * init_normal(seed, stream, elem)))` for embeddings, linears and `1 + w` norms,
/// 1.0 for plain norms and `dt_bias`, and the fixed-scale draws of [`TensorRole`]'s other roles.
#[inline]
pub fn init_value_bf16(role: TensorRole, seed: u64, stream: u32, elem: u64, init_std: f32) -> bf16 {
    match (role, init_normal_scale(role, init_std)) {
        (_, Some(scale)) => bf16::from_f32((scale * init_normal(seed, stream, elem)) as f32),
        (TensorRole::ALog, None) => {
            bf16::from_f32((0.01 + (16.0 - 0.01) * init_uniform(seed, stream, elem)).ln() as f32)
        }
        (_, None) => bf16::ONE,
    }
}

/// The standard deviation of `role`'s normal draws (`init_value_bf16` is
/// `bf16(f32(scale * init_normal(..)))`), or `None` for the roles that draw no normal (plain
/// norms and `dt_bias` are 1, `A_log` a uniform's log).
pub fn init_normal_scale(role: TensorRole, init_std: f32) -> Option<f64> {
    match role {
        TensorRole::Norm | TensorRole::DtBias | TensorRole::ALog => None,
        TensorRole::Embedding | TensorRole::Linear | TensorRole::NormOffset => Some(f64::from(init_std)),
        TensorRole::Scaled { gain } => Some(f64::from(gain) * f64::from(init_std)),
        TensorRole::Conv { kernel } => Some(1.0 / (3.0 * kernel.max(1) as f64).sqrt()),
    }
}

/// Elements `first..first + n` of one randomly initialised tensor (`init_value_bf16`), as a
/// backend's `fill_init` writes them.
#[derive(Clone, Copy, Debug)]
pub struct InitDraw {
    pub role: TensorRole,
    pub seed: u64,
    /// The tensor's Philox stream (its index in [`target_tensor_specs`]).
    pub stream: u32,
    pub std: f32,
    pub first: u64,
}

impl InitDraw {
    /// Element `i` of the draw (`first + i` of the tensor).
    pub fn value(&self, i: usize) -> bf16 {
        init_value_bf16(self.role, self.seed, self.stream, self.first + i as u64, self.std)
    }

    /// Elements `i0..i0 + len` as f32 (exact: they are bf16), drawn across cores.
    pub fn values_f32(&self, i0: usize, len: usize) -> Vec<f32> {
        (i0..i0 + len).into_par_iter().map(|i| self.value(i).to_f32()).collect()
    }
}

/// Fills `buf` (bf16 little-endian) with elements `first_elem..` of one tensor, one rayon task
/// per row of `cols` elements.
fn fill_init_bf16(buf: &mut [u8], spec: &TensorSpec, seed: u64, stream: u32, first_elem: u64, cols: usize, std: f32) {
    buf.par_chunks_mut(cols * 2).enumerate().for_each(|(r, row)| {
        let base = first_elem + (r * cols) as u64;
        for (j, out) in row.chunks_exact_mut(2).enumerate() {
            let v = init_value_bf16(spec.role, seed, stream, base + j as u64, std);
            out.copy_from_slice(&v.to_le_bytes());
        }
    });
}

/// Writes a randomly initialised target in Hugging Face layout to `out_dir` (created if needed):
/// `model.safetensors` (bf16) then `config.json`, both atomically, so a folder with a config.json
/// always has complete weights. Embedding and linears ~ N(0, init_std) (no lm_head when tied;
/// a hybrid's embedding and lm_head at [`HYBRID_EMBED_GAIN`] and [`HYBRID_LM_HEAD_GAIN`] times
/// that), norms = 1 (the other hybrid tensors: [`TensorRole`]). Tensor `t` of [`target_tensor_specs`] uses Philox stream `[t, domain::INIT]`, so the
/// result depends only on `(cfg, seed, init_std)`. Prints nothing.
pub fn init_target(cfg: &TargetConfig, seed: u64, init_std: f32, out_dir: impl AsRef<Path>) -> Result<()> {
    init_target_with_progress(cfg, seed, init_std, out_dir, &|_, _| {})
}

/// Makes `dir` ready for a new model: nothing to do where it holds none; where it holds one
/// (`config.json`, `*.safetensors`, a shard index), an error naming them unless `overwrite`, and
/// then they are removed (a stale index would send a loader to the old shards). Returns what was
/// removed.
pub fn clear_model_folder(dir: &Path, overwrite: bool) -> Result<Vec<PathBuf>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    if !dir.is_dir() {
        return Err(WeightsError::InvalidInput(format!("--out {}: is a file, not a folder", dir.display())));
    }
    let mut held: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir, "read directory"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            p.is_file()
                && (name == "config.json"
                    || name.ends_with(".safetensors")
                    || name.ends_with(".safetensors.index.json"))
        })
        .collect();
    held.sort();
    if held.is_empty() {
        return Ok(held);
    }
    if !overwrite {
        let names: Vec<String> =
            held.iter().filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
        return Err(WeightsError::InvalidInput(format!(
            "--out {}: already holds a model ({}); give --overwrite to replace it, or another --out",
            dir.display(),
            names.join(", ")
        )));
    }
    for p in &held {
        std::fs::remove_file(p).map_err(io_err(p, "remove"))?;
    }
    Ok(held)
}

/// [`init_target`] with `progress(bytes_written, total_bytes)` called (from a writer thread)
/// after each chunk of `model.safetensors` reaches the OS.
///
/// Fast enough for Qwen3-8B's shape (16 GB): tensors are generated row-parallel with rayon into
/// 64 MiB chunks that a writer thread streams to disk while the next chunk is generated, so
/// memory stays at a few chunks and generation overlaps the disk.
pub fn init_target_with_progress(
    cfg: &TargetConfig,
    seed: u64,
    init_std: f32,
    out_dir: impl AsRef<Path>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<()> {
    let out_dir = out_dir.as_ref();
    cfg.validate()?;
    if !(init_std.is_finite() && init_std >= 0.0) {
        return Err(WeightsError::InvalidInput(format!("init_std is {init_std}; it must be finite and >= 0")));
    }
    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir, "create directory"))?;
    let specs = target_tensor_specs(cfg);
    let stream_of = |t: usize| {
        u32::try_from(t)
            .map_err(|_| WeightsError::InvalidInput(format!("{} tensors exceed the u32 stream ids", specs.len())))
    };
    stream_of(specs.len())?;
    let layout: Vec<(&str, Dtype, &[usize])> =
        specs.iter().map(|s| (s.name.as_str(), Dtype::BF16, s.shape.as_slice())).collect();
    let metadata =
        HashMap::from([("dflash_engine_init".to_string(), format!("seed={seed} std={init_std} philox-domain=INIT"))]);
    let (header, data_bytes) = safetensors_header(&layout, Some(&metadata))?;
    let total = header.len() as u64 + data_bytes;

    let path = out_dir.join(SINGLE_FILE);
    write_atomic(&path, |w| {
        w.write_all(&header).map_err(io_err(&path, "write"))?;
        progress(header.len() as u64, total);
        let header_len = header.len() as u64;
        std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(INIT_QUEUE_DEPTH);
            let writer = scope.spawn(move || -> std::io::Result<()> {
                let mut done = header_len;
                for chunk in rx {
                    w.write_all(&chunk)?;
                    done += chunk.len() as u64;
                    progress(done, total);
                }
                Ok(())
            });
            'tensors: for (t, spec) in specs.iter().enumerate() {
                let cols = spec.shape.last().copied().unwrap_or(1).max(1);
                let rows = (spec.numel() / cols as u64) as usize;
                let rows_per_chunk = (INIT_CHUNK_BYTES / (cols * 2)).max(1);
                let mut r0 = 0;
                while r0 < rows {
                    let r1 = rows.min(r0 + rows_per_chunk);
                    let mut chunk = vec![0u8; (r1 - r0) * cols * 2];
                    let first = r0 as u64 * cols as u64;
                    fill_init_bf16(&mut chunk, spec, seed, t as u32, first, cols, init_std);
                    if tx.send(chunk).is_err() {
                        break 'tensors; // the writer stopped on an error, reported below
                    }
                    r0 = r1;
                }
            }
            drop(tx);
            match writer.join() {
                Ok(r) => r.map_err(io_err(&path, "write")),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    })?;
    write_file_atomic(out_dir.join(CONFIG_FILE), cfg.to_hf_json().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::TempDir;

    fn tiny() -> TargetConfig {
        TargetConfig::preset("tiny").unwrap()
    }

    fn init_tiny(tag: &str, seed: u64) -> TempDir {
        let dir = TempDir::new(tag);
        init_target(&tiny(), seed, DEFAULT_INIT_STD, &dir.0).unwrap();
        dir
    }

    /// The host path of `Backend::fill_init` (what the CPU backend, and CUDA for roles it cannot
    /// draw on the device, run) writes `init_value_bf16` of the tensor's elements `first..`, at
    /// the offset and nowhere else; each role's draw is its documented formula.
    #[test]
    fn fill_init_writes_the_draw() {
        use crate::backend::{cpu::CpuBackend, Backend};
        use crate::tensor::DType;
        let be = CpuBackend::new();
        let s = be.compute_stream();
        let roles = [
            TensorRole::Linear,
            TensorRole::Scaled { gain: 4 },
            TensorRole::Conv { kernel: 4 },
            TensorRole::NormOffset,
            TensorRole::ALog,
            TensorRole::Norm,
            TensorRole::DtBias,
        ];
        for (t, role) in roles.into_iter().enumerate() {
            let draw = InitDraw { role, seed: 99, stream: t as u32, std: 0.02, first: 1 << 33 };
            let (off, n) = (3, 1000);
            let mut b = be.alloc(&s, DType::BF16, off + n + 2).unwrap();
            be.fill(&s, &mut b, -7.0).unwrap();
            be.fill_init(&s, &mut b, off, n, &draw).unwrap();
            let got = be.download(&s, &b).unwrap();
            for i in 0..n {
                let e = draw.first + i as u64;
                let normal = |sd: f64| bf16::from_f32((sd * init_normal(99, t as u32, e)) as f32);
                let want = match role {
                    TensorRole::Linear | TensorRole::NormOffset => normal(0.02f32.into()),
                    TensorRole::Scaled { gain } => normal(f64::from(gain) * f64::from(0.02f32)),
                    TensorRole::Conv { kernel } => normal(1.0 / (3.0 * kernel as f64).sqrt()),
                    TensorRole::ALog => {
                        bf16::from_f32((0.01 + (16.0 - 0.01) * init_uniform(99, t as u32, e)).ln() as f32)
                    }
                    _ => bf16::ONE,
                };
                assert_eq!(got[off + i].to_bits(), want.to_f32().to_bits(), "{role:?} element {i}");
            }
            assert!(got[..off].iter().chain(&got[off + n..]).all(|&v| v == -7.0), "{role:?}: wrote outside its range");
        }
    }

    #[test]
    fn init_normal_matches_the_sequential_stream() {
        for (seed, stream) in [(0u64, 0u32), (1234, 7), (u64::MAX, 300)] {
            let mut seq = rng::Philox::new(seed, [stream, rng::domain::INIT]);
            for e in 0..5000 {
                assert_eq!(seq.normal().to_bits(), init_normal(seed, stream, e).to_bits(), "seed {seed} elem {e}");
            }
        }
    }

    #[test]
    fn tiny_init_round_trips_with_the_right_statistics() {
        let cfg = tiny();
        let dir = init_tiny("stats", 42);
        let files = ModelFiles::open(&dir.0).unwrap();
        assert_eq!(files.config(), &cfg);
        let specs = target_tensor_specs(&cfg);
        assert_eq!(specs.len(), 1 + 11 * 6 + 1 + 1);
        assert_eq!(files.tensors().names().len(), specs.len());
        let total: u64 = specs.iter().map(TensorSpec::numel).sum();
        assert_eq!(total, cfg.num_params());
        for (t, spec) in specs.iter().enumerate() {
            let info = files.tensor_info(&spec.name).unwrap();
            assert_eq!((info.dtype, &info.shape), (Dtype::BF16, &spec.shape), "{}", spec.name);
            let v = files.tensor_f32(&spec.name, &spec.shape).unwrap();
            assert_eq!(v.len() as u64, spec.numel());
            match spec.role {
                TensorRole::Norm => assert!(v.iter().all(|&x| x == 1.0), "{}", spec.name),
                TensorRole::Embedding | TensorRole::Linear => {
                    // Sample mean has sd std/sqrt(n), sample sd has sd ~ std/sqrt(2n); smallest
                    // tensor here has n = 2048, so 5-sigma bounds are 0.11*std and 0.08*std.
                    let n = v.len() as f64;
                    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
                    let var = v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
                    let std = f64::from(DEFAULT_INIT_STD);
                    assert!(mean.abs() < 5.0 * std / n.sqrt(), "{}: mean {mean}", spec.name);
                    assert!(
                        (var.sqrt() / std - 1.0).abs() < 5.0 / (2.0 * n).sqrt(),
                        "{}: std {}",
                        spec.name,
                        var.sqrt()
                    );
                    // And the exact values are the documented function of (seed, tensor, element).
                    for e in [0usize, 1, v.len() / 2, v.len() - 1] {
                        let want = init_value_bf16(spec.role, 42, t as u32, e as u64, DEFAULT_INIT_STD).to_f32();
                        assert_eq!(v[e], want, "{}[{e}]", spec.name);
                    }
                }
                other => panic!("{}: a Qwen3 target has no {other:?} tensor", spec.name),
            }
        }
        assert_eq!(files.lm_head_name(), names::LM_HEAD);
        // The config.json that was written is the one transformers should load.
        let written: Value = serde_json::from_str(&std::fs::read_to_string(dir.0.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(written, cfg.to_hf_value());
    }

    /// The key list of transformers' `Qwen3_5ForCausalLM` for a text config, written out from
    /// its modeling source (`Qwen3_5GatedDeltaNet.__init__`, `Qwen3_5Attention.__init__`,
    /// `Qwen3_5DecoderLayer`, `Qwen3_5TextModel`, the untied `lm_head`), with the shapes of its
    /// `nn.Linear([out, in])`, `nn.Conv1d` (`[C, 1, K]`, groups = C) and `nn.Parameter`s.
    fn hf_qwen35_keys(cfg: &TargetConfig) -> Vec<(String, Vec<usize>)> {
        let hy = cfg.hybrid().unwrap();
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (hk, hv, dk, dv) =
            (hy.linear_num_key_heads, hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim);
        let (kd, vd, k) = (hk * dk, hv * dv, hy.linear_conv_kernel_dim);
        let mut keys = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let mixer: Vec<(&str, Vec<usize>)> = match hy.layer_types[l] {
                LayerType::Full => vec![
                    ("self_attn.q_proj.weight", vec![nq * hd * 2, h]),
                    ("self_attn.k_proj.weight", vec![nkv * hd, h]),
                    ("self_attn.v_proj.weight", vec![nkv * hd, h]),
                    ("self_attn.o_proj.weight", vec![h, nq * hd]),
                    ("self_attn.q_norm.weight", vec![hd]),
                    ("self_attn.k_norm.weight", vec![hd]),
                ],
                LayerType::Linear => vec![
                    ("linear_attn.conv1d.weight", vec![2 * kd + vd, 1, k]),
                    ("linear_attn.dt_bias", vec![hv]),
                    ("linear_attn.A_log", vec![hv]),
                    ("linear_attn.norm.weight", vec![dv]),
                    ("linear_attn.out_proj.weight", vec![h, vd]),
                    ("linear_attn.in_proj_qkv.weight", vec![2 * kd + vd, h]),
                    ("linear_attn.in_proj_z.weight", vec![vd, h]),
                    ("linear_attn.in_proj_b.weight", vec![hv, h]),
                    ("linear_attn.in_proj_a.weight", vec![hv, h]),
                ],
            };
            for (s, shape) in mixer {
                keys.push((p(s), shape));
            }
            keys.push((p("mlp.gate_proj.weight"), vec![i, h]));
            keys.push((p("mlp.up_proj.weight"), vec![i, h]));
            keys.push((p("mlp.down_proj.weight"), vec![h, i]));
            keys.push((p("input_layernorm.weight"), vec![h]));
            keys.push((p("post_attention_layernorm.weight"), vec![h]));
        }
        keys.push(("model.norm.weight".to_string(), vec![h]));
        keys.push(("lm_head.weight".to_string(), vec![v, h]));
        keys.sort();
        keys
    }

    fn qwen35_tiny() -> TargetConfig {
        TargetConfig::preset("qwen3.5-tiny").unwrap()
    }

    #[test]
    fn qwen35_tiny_checkpoint_has_exactly_transformers_keys_and_sane_init() {
        let cfg = qwen35_tiny();
        let dir = TempDir::new("q35-init");
        init_target(&cfg, 11, 0.05, &dir.0).unwrap();
        let files = ModelFiles::open(&dir.0).unwrap();
        assert_eq!(files.config(), &cfg);
        assert_eq!(files.text_prefix(), "model.");
        let mut stored: Vec<(String, Vec<usize>)> = files
            .tensors()
            .names()
            .iter()
            .map(|n| (n.to_string(), files.tensors().tensor_info(n).unwrap().shape))
            .collect();
        stored.sort();
        assert_eq!(stored, hf_qwen35_keys(&cfg), "no missing and no unexpected keys");
        let specs = target_tensor_specs(&cfg);
        assert_eq!(specs.iter().map(TensorSpec::numel).sum::<u64>(), cfg.num_params());
        let written: Value = serde_json::from_str(&std::fs::read_to_string(dir.0.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(written["architectures"], json!(["Qwen3_5ForCausalLM"]));
        assert_eq!(written["model_type"], "qwen3_5_text");
        let get = |name: &str| {
            let info = files.tensor_info(name).unwrap();
            files.tensor_f32(name, &info.shape).unwrap()
        };
        // `1 + w` norms near 0 (not exactly: a forward ignoring w must show), the GDN output norm
        // and dt_bias 1, A_log = ln(U(0.01, 16)), the conv at PyTorch's default scale.
        for name in
            ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_norm.weight"]
        {
            let w = get(name);
            assert!(w.iter().all(|x| x.abs() < 0.3) && w.iter().any(|&x| x != 0.0), "{name}: {w:?}");
        }
        assert!(get("model.layers.0.linear_attn.norm.weight").iter().all(|&x| x == 1.0));
        assert!(get("model.layers.0.linear_attn.dt_bias").iter().all(|&x| x == 1.0));
        let a_log = get("model.layers.1.linear_attn.A_log");
        assert!(a_log.iter().all(|&x| x >= (0.01f32).ln() - 0.01 && x <= (16f32).ln() + 0.01), "{a_log:?}");
        assert!(a_log.windows(2).any(|w| w[0] != w[1]));
        let conv = get("model.layers.0.linear_attn.conv1d.weight");
        let sd = (conv.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / conv.len() as f64).sqrt();
        assert!((sd - (1.0f64 / 12.0).sqrt()).abs() < 0.03, "conv sd {sd}");
        // The embedding and the lm_head at their gains over init_std, the layers' matrices at it
        // (n >= 4096 here: a sample sd within 5 / sqrt(2n) < 6% of the std).
        for (name, gain) in [
            ("model.embed_tokens.weight", HYBRID_EMBED_GAIN),
            ("lm_head.weight", HYBRID_LM_HEAD_GAIN),
            ("model.layers.0.linear_attn.in_proj_qkv.weight", 1),
            ("model.layers.3.self_attn.o_proj.weight", 1),
        ] {
            let w = get(name);
            let sd = (w.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
            assert!((sd / (f64::from(gain) * 0.05) - 1.0).abs() < 0.06, "{name}: sd {sd}, want {gain} x 0.05");
        }
    }

    /// A vision-language layout: the text model under `model.language_model.`, plus a vision
    /// tower and an MTP head the target never reads.
    fn write_vlm_copy(src: &ModelFiles, dir: &Path, drop: Option<&str>, reshape: Option<&str>) {
        let mut tensors = Vec::new();
        for name in src.tensors().names() {
            if Some(name) == drop {
                continue;
            }
            let raw = src.tensors().tensor_bytes(name).unwrap();
            let new_name = match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name.to_string(),
            };
            let mut shape = raw.shape.to_vec();
            if Some(name) == reshape {
                shape = vec![shape.iter().product()];
            }
            tensors.push((new_name, raw.dtype, shape, raw.bytes.to_vec()));
        }
        tensors.push(("model.visual.blocks.0.attn.qkv.weight".into(), Dtype::BF16, vec![2, 2], vec![0; 8]));
        tensors.push(("mtp.fc.weight".into(), Dtype::BF16, vec![2, 2], vec![0; 8]));
        tensors.push(("mtp.layers.0.embed_tokens.weight".into(), Dtype::BF16, vec![2, 2], vec![0; 8]));
        write_safetensors_atomic(dir.join(SINGLE_FILE), &tensors, None).unwrap();
        let text = src.config().to_hf_value();
        let vlm = json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": false,
            "text_config": text,
        });
        let mut vlm = vlm;
        vlm["text_config"]["model_type"] = json!("qwen3_5_text");
        write_file_atomic(dir.join(CONFIG_FILE), vlm.to_string().as_bytes()).unwrap();
    }

    #[test]
    fn vlm_layout_is_found_by_probing_and_reads_the_same_tensors() {
        let src_dir = TempDir::new("q35-src");
        init_target(&qwen35_tiny(), 5, 0.05, &src_dir.0).unwrap();
        let src = ModelFiles::open(&src_dir.0).unwrap();
        let dir = TempDir::new("q35-vlm");
        write_vlm_copy(&src, &dir.0, None, None);
        let vlm = ModelFiles::open(&dir.0).unwrap();
        assert_eq!(vlm.text_prefix(), "model.language_model.");
        assert_eq!(vlm.config().architectures, vec!["Qwen3_5ForConditionalGeneration"]);
        for spec in target_tensor_specs(src.config()) {
            assert_eq!(
                vlm.tensor_f32(&spec.name, &spec.shape).unwrap(),
                src.tensor_f32(&spec.name, &spec.shape).unwrap()
            );
        }
        assert_eq!(vlm.stored_name("lm_head.weight"), "lm_head.weight");
    }

    #[test]
    fn missing_or_misshaped_linear_attn_tensor_names_tensor_file_and_shape() {
        let src_dir = TempDir::new("q35-src2");
        init_target(&qwen35_tiny(), 5, 0.05, &src_dir.0).unwrap();
        let src = ModelFiles::open(&src_dir.0).unwrap();
        let dir = TempDir::new("q35-missing");
        write_vlm_copy(&src, &dir.0, Some("model.layers.2.linear_attn.A_log"), None);
        let e = ModelFiles::open(&dir.0).err().unwrap();
        match &e {
            WeightsError::MissingTensor { name, expected, searched, .. } => {
                assert_eq!(name, "model.language_model.layers.2.linear_attn.A_log");
                assert_eq!(expected, &Some(vec![4]));
                assert_eq!(searched, &vec![dir.0.join(SINGLE_FILE)]);
            }
            other => panic!("{other}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("A_log") && msg.contains("[4]") && msg.contains(SINGLE_FILE), "{msg}");
        let dir = TempDir::new("q35-shape");
        write_vlm_copy(&src, &dir.0, None, Some("model.layers.0.linear_attn.conv1d.weight"));
        match ModelFiles::open(&dir.0).err().unwrap() {
            WeightsError::WrongShape { name, file, expected, found } => {
                assert_eq!(name, "model.language_model.layers.0.linear_attn.conv1d.weight");
                assert_eq!(file, dir.0.join(SINGLE_FILE));
                assert_eq!((expected, found), (vec![128, 1, 4], vec![512]));
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn init_is_deterministic_per_seed() {
        let a = init_tiny("det-a", 7);
        let b = init_tiny("det-b", 7);
        let c = init_tiny("det-c", 8);
        let read = |d: &TempDir| std::fs::read(d.0.join(SINGLE_FILE)).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_ne!(read(&a), read(&c));
    }

    #[test]
    fn written_file_is_standard_safetensors() {
        let dir = init_tiny("std", 1);
        let bytes = std::fs::read(dir.0.join(SINGLE_FILE)).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!((8 + header_len) % 8, 0, "tensor data must start 8-byte aligned");
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), target_tensor_specs(&tiny()).len());
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    }

    #[test]
    fn tied_target_has_no_lm_head() {
        let mut cfg = tiny();
        cfg.tie_word_embeddings = true;
        let dir = TempDir::new("tied");
        init_target(&cfg, 3, 0.02, &dir.0).unwrap();
        let files = ModelFiles::open(&dir.0).unwrap();
        assert!(!files.has(names::LM_HEAD));
        assert_eq!(files.lm_head_name(), names::EMBED_TOKENS);
    }

    #[test]
    fn progress_reaches_the_file_size() {
        let dir = TempDir::new("progress");
        let last = std::sync::Mutex::new((0u64, 0u64));
        init_target_with_progress(&tiny(), 5, 0.02, &dir.0, &|done, total| {
            let mut l = last.lock().unwrap();
            assert!(done >= l.0 && done <= total);
            *l = (done, total);
        })
        .unwrap();
        let size = std::fs::metadata(dir.0.join(SINGLE_FILE)).unwrap().len();
        assert_eq!(*last.lock().unwrap(), (size, size));
    }

    #[test]
    fn missing_dir_config_and_weights() {
        let dir = TempDir::new("missing");
        let nowhere = dir.0.join("no-such-model");
        match ModelFiles::open(&nowhere) {
            Err(WeightsError::MissingFile { path }) => assert_eq!(path, nowhere),
            other => panic!("{:?}", other.err()),
        }
        let e = ModelFiles::open(&dir.0).err().unwrap();
        assert!(matches!(&e, WeightsError::MissingFile { path } if path.ends_with(CONFIG_FILE)), "{e}");
        assert!(e.to_string().contains("init-model"), "{e}");
        std::fs::write(dir.0.join(CONFIG_FILE), tiny().to_hf_json()).unwrap();
        let e = ModelFiles::open(&dir.0).err().unwrap();
        assert!(matches!(&e, WeightsError::MissingFile { path } if path.ends_with(SINGLE_FILE)), "{e}");
    }

    #[test]
    fn bad_config_is_a_config_error() {
        let dir = init_tiny("badcfg", 1);
        std::fs::write(dir.0.join(CONFIG_FILE), r#"{"model_type": "llama"}"#).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::Config(ConfigError::UnsupportedModel { .. }))));
    }

    #[test]
    fn missing_tensor_names_the_file_and_suggests() {
        let dir = init_tiny("missing-tensor", 1);
        let files = ModelFiles::open(&dir.0).unwrap();
        let typo = "model.layers.0.self_attn.q_proj.weights";
        match files.tensor_f32(typo, &[64, 64]) {
            Err(WeightsError::MissingTensor { name, expected, searched, suggestions }) => {
                assert_eq!(name, typo);
                assert_eq!(expected, Some(vec![64, 64]));
                assert_eq!(searched, vec![dir.0.join(SINGLE_FILE)]);
                assert_eq!(suggestions[0], "model.layers.0.self_attn.q_proj.weight");
            }
            other => panic!("{:?}", other.err()),
        }
        // A missing `model.` prefix is found too.
        let e = files.tensor_info("layers.3.mlp.up_proj.weight").unwrap_err();
        assert!(e.to_string().contains("model.layers.3.mlp.up_proj.weight"), "{e}");
    }

    #[test]
    fn wrong_shape_reports_both_shapes() {
        let dir = init_tiny("shape", 1);
        let files = ModelFiles::open(&dir.0).unwrap();
        match files.tensor_f32(names::EMBED_TOKENS, &[64, 256]) {
            Err(WeightsError::WrongShape { expected, found, .. }) => {
                assert_eq!((expected, found), (vec![64, 256], vec![256, 64]));
            }
            other => panic!("{:?}", other.err()),
        }
        // A checkpoint that disagrees with its config fails at open.
        let mut cfg = tiny();
        cfg.intermediate_size = 128;
        std::fs::write(dir.0.join(CONFIG_FILE), cfg.to_hf_json()).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::WrongShape { .. })));
    }

    #[test]
    fn truncated_file_is_reported_not_read() {
        let dir = init_tiny("trunc", 1);
        let path = dir.0.join(SINGLE_FILE);
        let size = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(size - 10).unwrap();
        match ModelFiles::open(&dir.0) {
            Err(WeightsError::Truncated { needed, actual, .. }) => assert_eq!((needed, actual), (size, size - 10)),
            other => panic!("{:?}", other.err()),
        }
        // Cut inside the header, and below the 8-byte length field.
        f.set_len(100).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::Truncated { actual: 100, .. })));
        f.set_len(3).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::Truncated { needed: 8, actual: 3, .. })));
    }

    #[test]
    fn garbage_header_is_malformed() {
        let dir = init_tiny("garbage", 1);
        let mut bytes = 16u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"this is not json");
        std::fs::write(dir.0.join(SINGLE_FILE), &bytes).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::MalformedHeader { .. })));
        // An absurd length field (e.g. a text file) is not mistaken for a truncated file.
        std::fs::write(dir.0.join(SINGLE_FILE), b"hello world, not a model").unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::MalformedHeader { .. })));
        // Extra bytes after the last tensor.
        let dir = init_tiny("trailing", 1);
        let path = dir.0.join(SINGLE_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0; 8]);
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::MalformedHeader { .. })));
    }

    #[test]
    fn sharded_index_loads_every_tensor() {
        let src = init_tiny("shard-src", 9);
        let single = ModelFiles::open(&src.0).unwrap();
        let specs = target_tensor_specs(single.config());
        let dir = TempDir::new("shard");
        let shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let mut weight_map = Map::new();
        let half = specs.len() / 2;
        for (k, part) in [&specs[..half], &specs[half..]].into_iter().enumerate() {
            let tensors: Vec<_> = part
                .iter()
                .map(|s| {
                    let raw = single.tensor_bytes(&s.name).unwrap();
                    weight_map.insert(s.name.clone(), json!(shard_names[k]));
                    (s.name.clone(), raw.dtype, s.shape.clone(), raw.bytes.to_vec())
                })
                .collect();
            write_safetensors_atomic(dir.0.join(shard_names[k]), &tensors, None).unwrap();
        }
        let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        write_file_atomic(dir.0.join(INDEX_FILE), index.to_string().as_bytes()).unwrap();
        write_file_atomic(dir.0.join(CONFIG_FILE), single.config().to_hf_json().as_bytes()).unwrap();

        let sharded = ModelFiles::open(&dir.0).unwrap();
        assert_eq!(sharded.tensors().files().len(), 2);
        for s in &specs {
            assert_eq!(sharded.tensor_f32(&s.name, &s.shape).unwrap(), single.tensor_f32(&s.name, &s.shape).unwrap());
        }
        assert!(sharded.tensor_info(&specs[0].name).unwrap().file.ends_with(shard_names[0]));
        assert!(sharded.tensor_info(&specs[half].name).unwrap().file.ends_with(shard_names[1]));

        // An index that points at the wrong shard, or a missing shard, is reported.
        let mut bad = weight_map.clone();
        bad.insert(specs[0].name.clone(), json!(shard_names[1]));
        std::fs::write(dir.0.join(INDEX_FILE), json!({"weight_map": bad}).to_string()).unwrap();
        assert!(matches!(ModelFiles::open(&dir.0), Err(WeightsError::MalformedIndex { .. })));
        std::fs::remove_file(dir.0.join(shard_names[1])).unwrap();
        std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
        assert!(
            matches!(ModelFiles::open(&dir.0), Err(WeightsError::MissingFile { path }) if path.ends_with(shard_names[1]))
        );
    }

    #[test]
    fn f16_f32_convert_exactly_and_other_dtypes_are_refused() {
        let dir = TempDir::new("dtypes");
        let vals = [0.0f32, -1.5, 3.140625, 65504.0, 1e-7];
        let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = vals.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        let path = dir.0.join("t.safetensors");
        write_safetensors_atomic(
            &path,
            &[
                ("a".into(), Dtype::F32, vec![5], f32_bytes),
                ("b".into(), Dtype::F16, vec![5], f16_bytes),
                ("c".into(), Dtype::I32, vec![1], vec![1, 0, 0, 0]),
            ],
            Some(HashMap::from([("note".to_string(), "test".to_string())])),
        )
        .unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        assert_eq!(store.tensor_f32("a", &[5]).unwrap(), vals);
        let want: Vec<f32> = vals.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(store.tensor_f32("b", &[5]).unwrap(), want);
        assert!(matches!(store.tensor_f32("c", &[1]), Err(WeightsError::UnsupportedDtype { dtype: Dtype::I32, .. })));
        // Byte counts are checked on write.
        let short = [("x".to_string(), Dtype::BF16, vec![4], vec![0u8; 6])];
        assert!(matches!(write_safetensors_atomic(&path, &short, None), Err(WeightsError::InvalidInput(_))));
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp_file() {
        let dir = TempDir::new("atomic");
        let path = dir.0.join("config.json");
        std::fs::write(&path, "old contents that are longer").unwrap();
        write_file_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let st = dir.0.join("w.safetensors");
        write_safetensors_atomic(&st, &[("a".into(), Dtype::F32, vec![1], vec![0; 4])], None).unwrap();
        write_safetensors_atomic(&st, &[("b".into(), Dtype::F32, vec![2], vec![0; 8])], None).unwrap();
        let store = TensorStore::open_file(&st).unwrap();
        assert_eq!(store.names(), vec!["b"]);
        let mut entries: Vec<String> =
            std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        entries.sort();
        assert_eq!(entries, vec!["config.json", "w.safetensors"]);
        // A failed write (here: into a missing directory) leaves nothing behind either.
        assert!(write_file_atomic(dir.0.join("no-dir").join("x.json"), b"x").is_err());
    }

    #[test]
    fn drafter_specs_follow_the_public_layout() {
        let target = TargetConfig::preset("qwen3-8b-shape").unwrap();
        let d = DrafterConfig::for_target(&target, 5, 16, None).unwrap();
        let specs = drafter_tensor_specs(&d);
        assert_eq!(specs[0], TensorSpec::new("fc.weight", vec![4096, 5 * 4096], TensorRole::Linear));
        assert_eq!(specs.len(), 2 + 11 * 5 + 1);
        assert!(specs.iter().any(|s| s.name == "layers.4.self_attn.k_proj.weight" && s.shape == [1024, 4096]));
        let trained: u64 = specs.iter().map(TensorSpec::numel).sum();
        assert_eq!(trained, d.num_params());
    }

    /// Throughput check for the real-size preset (~16 GB written). Run on a big machine with
    /// `DFLASH_INIT_BENCH_DIR=/some/disk cargo test --release --lib init_speed -- --ignored
    /// --nocapture`; `DFLASH_INIT_BENCH_PRESET` picks another preset.
    #[test]
    #[ignore = "writes 16 GB; manual throughput check on a 16-core machine"]
    fn init_speed() {
        let Some(base) = std::env::var_os("DFLASH_INIT_BENCH_DIR") else { return };
        let preset = std::env::var("DFLASH_INIT_BENCH_PRESET").unwrap_or_else(|_| "qwen3-8b-shape".into());
        let dir = PathBuf::from(base).join(format!("{preset}-{}", std::process::id()));
        let cfg = TargetConfig::preset(&preset).unwrap();
        let t0 = std::time::Instant::now();
        init_target(&cfg, 0, DEFAULT_INIT_STD, &dir).unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let size = std::fs::metadata(dir.join(SINGLE_FILE)).unwrap().len();
        let threads = rayon::current_num_threads();
        println!(
            "init {preset}: {:.3} GB in {secs:.2} s = {:.2} GB/s, {:.1} ns/element/thread ({threads} threads)",
            size as f64 / 1e9,
            size as f64 / 1e9 / secs,
            secs * 1e9 * threads as f64 / (size as f64 / 2.0)
        );
        let t0 = std::time::Instant::now();
        let files = ModelFiles::open(&dir).unwrap();
        println!("open + check: {:.2} s", t0.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(&dir);
        drop(files);
    }
}
