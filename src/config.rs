//! Model configuration: the Qwen3 subset of a Hugging Face `config.json` (the frozen target), the
//! presets `init-model` can random-initialise, the drafter's config and its checkpoint layout, and
//! the rule that picks which target layers the drafter taps (DFLASH.md section 1).
//!
//! Configs are read through a JSON object rather than a plain `#[derive(Deserialize)]` so that
//! every problem names the file, the field and what to do, instead of serde's "missing field at
//! line 1 column 812".

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::Path;

/// The source label used when a config comes from a string rather than a file.
const FROM_STRING: &str = "<config string>";

/// Names accepted by [`TargetConfig::preset`].
pub const PRESET_NAMES: [&str; 6] =
    ["tiny", "small", "qwen3-8b-shape", "qwen3.5-tiny", "qwen3.5-small", "qwen3.6-27b-shape"];

/// Drafter depth used when the caller does not choose one (public DFlash drafters use 5).
pub const DEFAULT_DRAFTER_LAYERS: usize = 5;
/// Slots per draft block (slot 0 = the anchor token, the rest are mask tokens).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Qwen3's tokenizer has 151,669 tokens (ids 0..=151668) but a 151,936-row embedding; the first
/// unused row, 151669, is the mask token public DFlash drafters for Qwen3 use.
pub const QWEN3_VOCAB_SIZE: usize = 151_936;
pub const QWEN3_MASK_TOKEN_ID: u32 = 151_669;

/// Qwen3.5/3.6's embedding has 248,320 rows; public DFlash drafters for them use 248070 as the
/// mask token.
pub const QWEN35_VOCAB_SIZE: usize = 248_320;
pub const QWEN35_MASK_TOKEN_ID: u32 = 248_070;

/// Everything that can be wrong with a config. Each message names the source (file path or
/// `<config string>`) and, where it is not obvious, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: not valid JSON ({source}); expected a Hugging Face config.json object")]
    Json {
        file: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: required field `{field}` is missing; {hint}")]
    MissingField { file: String, field: &'static str, hint: &'static str },
    #[error("{file}: field `{field}` {reason}")]
    InvalidField { file: String, field: &'static str, reason: String },
    #[error(
        "{file}: model_type is \"{model_type}\", but only Qwen3 dense targets (model_type \"qwen3\", \
         Qwen3ForCausalLM) and Qwen3.5/3.6 dense hybrid targets (model_type \"qwen3_5\" or \
         \"qwen3_5_text\") are supported; MoE (qwen3_moe, qwen3_5_moe) and other families are not \
         implemented: train against a dense model"
    )]
    UnsupportedModel { file: String, model_type: String },
    #[error(
        "{file}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads \
         ({kv_heads}); grouped-query attention needs every kv head to serve the same number of \
         query heads, so the config is inconsistent"
    )]
    HeadsNotDivisible { file: String, heads: usize, kv_heads: usize },
    #[error(
        "{file}: RoPE type \"{rope_type}\" (in `{field}`) is not supported; only plain RoPE \
         (rope_type \"default\") is implemented. Train against the model without context \
         extension (remove `{field}`)"
    )]
    UnsupportedRope { file: String, field: &'static str, rope_type: String },
    #[error("unknown preset \"{name}\"; valid presets: {}", PRESET_NAMES.join(", "))]
    UnknownPreset { name: String },
    #[error(
        "--drafter-config {name}: not a built-in recipe ({}) and not a drafter config.json file",
        RECIPE_NAMES.join(", ")
    )]
    UnknownRecipe { name: String },
    #[error(
        "tap layer {id} is out of range: the target has {num_layers} decoder layers, so tap ids \
         must be in 0..{num_layers} (0-based; vLLM-style ids are one higher)"
    )]
    TapOutOfRange { id: usize, num_layers: usize },
    #[error(
        "tap layers {ids:?} must be in ascending order (0-based target layer ids, packed in \
         this order; a repeat is allowed, as the default rule makes for very shallow targets)"
    )]
    TapsNotSorted { ids: Vec<usize> },
    #[error("the drafter needs at least one tapped target layer; the tap list is empty")]
    NoTaps,
    #[error(
        "cannot derive default tap layers for a {num_layers}-layer target with {n} taps: the rule \
         round(1 + i*(L-4)/(n-1)) needs L >= 4; pass the tap layer ids explicitly"
    )]
    TooFewLayersForDefaultTaps { num_layers: usize, n: usize },
    #[error(
        "the target config has no mask_token_id and its vocabulary ({vocab_size}) is not \
         Qwen3's ({QWEN3_VOCAB_SIZE}); set mask_token_id to an unused embedding row"
    )]
    NoMaskToken { vocab_size: usize },
    #[error("drafter config: {field} {reason}")]
    InvalidDrafter { field: &'static str, reason: String },
    #[error(
        "drafter and target do not match: {field} is {drafter} in the drafter but {target} in \
         the target; a drafter only works with the target shape it was trained against"
    )]
    TargetMismatch { field: &'static str, drafter: String, target: String },
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// The per-layer dimensions shared by target and drafter layers (both are Qwen3 layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDims {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
}

impl LayerDims {
    /// Width of the query projection output, `nq * hd` (need not equal `hidden_size`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    /// Width of each of the key and value projection outputs, `nkv * hd`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// Query heads served by one kv head.
    pub fn gqa_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
    /// Parameters of one Qwen3 decoder layer (4 attention projections, 3 MLP projections,
    /// 2 hidden-size norms, 2 head-dim norms).
    pub fn params_per_layer(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (q, kv, hd) = (self.q_dim() as u64, self.kv_dim() as u64, self.head_dim as u64);
        2 * q * h + 2 * kv * h + 3 * i * h + 2 * h + 2 * hd
    }
}

// ---------------------------------------------------------------------------------------------
// Reading JSON objects field by field
// ---------------------------------------------------------------------------------------------

/// A JSON object plus the name of the file it came from, with typed getters whose errors name
/// the field. `null` counts as absent, as it does for Hugging Face.
struct Fields<'a> {
    file: &'a str,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> ConfigError {
        ConfigError::InvalidField { file: self.file.to_string(), field, reason: reason.into() }
    }

    fn opt_usize(&self, field: &'static str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.invalid(field, format!("must be a non-negative integer, found {v}"))),
        }
    }

    fn req_usize(&self, field: &'static str, hint: &'static str) -> Result<usize> {
        self.opt_usize(field)?.ok_or_else(|| ConfigError::MissingField { file: self.file.to_string(), field, hint })
    }

    /// A size that must be present and positive.
    fn req_positive(&self, field: &'static str, hint: &'static str) -> Result<usize> {
        let v = self.req_usize(field, hint)?;
        if v == 0 {
            return Err(self.invalid(field, "is 0; it must be positive"));
        }
        Ok(v)
    }

    fn opt_u32(&self, field: &'static str) -> Result<Option<u32>> {
        match self.opt_usize(field)? {
            None => Ok(None),
            Some(x) => {
                u32::try_from(x).map(Some).map_err(|_| self.invalid(field, format!("({x}) does not fit in 32 bits")))
            }
        }
    }

    /// A token id that may be written as one integer or as a list (`eos_token_id` often is).
    fn opt_u32_list(&self, field: &'static str) -> Result<Vec<u32>> {
        let bad = || self.invalid(field, "must be a token id or a list of token ids");
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => {
                items.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)).collect()
            }
            Some(v) => v.as_u64().and_then(|x| u32::try_from(x).ok()).map(|x| vec![x]).ok_or_else(bad),
        }
    }

    fn opt_f64(&self, field: &'static str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.invalid(field, format!("must be a number, found {v}"))),
        }
    }

    fn opt_bool(&self, field: &'static str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.invalid(field, format!("must be true or false, found {v}")))
            }
        }
    }

    fn opt_str(&self, field: &'static str) -> Result<Option<&'a str>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.invalid(field, format!("must be a string, found {v}"))),
        }
    }

    fn opt_str_list(&self, field: &'static str) -> Result<Vec<String>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(|| self.invalid(field, "must be a list of strings")))
                .collect(),
            Some(_) => Err(self.invalid(field, "must be a list of strings")),
        }
    }

    fn opt_object(&self, field: &'static str) -> Result<Option<Fields<'a>>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields { file: self.file, map })),
            Some(v) => Err(self.invalid(field, format!("must be a JSON object, found {v}"))),
        }
    }
}

fn parse_object(text: &str, file: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ConfigError::InvalidField {
            file: file.to_string(),
            field: "<root>",
            reason: "must be a JSON object".to_string(),
        }),
        Err(source) => Err(ConfigError::Json { file: file.to_string(), source }),
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io { file: path.display().to_string(), source })
}

/// The RoPE fields of a config: base frequency and the fraction of each head that rotates, when
/// the file names them. Accepts transformers-4 style (top-level `rope_theta`,
/// `partial_rotary_factor`, optional `rope_scaling`) and transformers-5 style (`rope_parameters:
/// {rope_type, rope_theta, partial_rotary_factor}`). Any type other than "default" changes the
/// rotation and is rejected. Multimodal keys (`mrope_section`, `mrope_interleaved`) are ignored:
/// for text-only input every position row is equal and M-RoPE is plain 1-D RoPE.
fn read_rope(f: &Fields) -> Result<(Option<f64>, Option<f64>)> {
    let top = f.opt_f64("rope_theta")?;
    let top_partial = f.opt_f64("partial_rotary_factor")?;
    let (mut nested, mut nested_partial) = (None, None);
    for field in ["rope_parameters", "rope_scaling"] {
        let Some(obj) = f.opt_object(field)? else { continue };
        let rope_type = match obj.opt_str("rope_type")? {
            Some(t) => Some(t),
            None => obj.opt_str("type")?, // transformers < 4.45 spelled it `type`
        };
        let rope_type = rope_type.unwrap_or("default");
        if rope_type != "default" {
            return Err(ConfigError::UnsupportedRope {
                file: f.file.to_string(),
                field,
                rope_type: rope_type.to_string(),
            });
        }
        if let Some(p) = obj.opt_f64("partial_rotary_factor")? {
            nested_partial = Some(p);
        }
        if field == "rope_parameters" {
            nested = obj.opt_f64("rope_theta")?;
        }
    }
    let agree = |field: &'static str, a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a != b => {
            Err(f.invalid(field, format!("is {a} but rope_parameters.{field} is {b}; they must agree (remove one)")))
        }
        (Some(a), _) | (None, Some(a)) => Ok(Some(a)),
        (None, None) => Ok(None),
    };
    let theta = agree("rope_theta", top, nested)?;
    if let Some(theta) = theta {
        if !(theta.is_finite() && theta > 0.0) {
            return Err(f.invalid("rope_theta", format!("is {theta}; it must be a positive number")));
        }
    }
    let partial = agree("partial_rotary_factor", top_partial, nested_partial)?;
    if let Some(p) = partial {
        if !(p > 0.0 && p <= 1.0) {
            return Err(f.invalid("partial_rotary_factor", format!("is {p}; it must be in (0, 1]")));
        }
    }
    Ok((theta, partial))
}

/// The RoPE base of a Qwen3-style config (full-width rotation only; 1e6 when absent, Qwen3's value
/// and transformers' Qwen3Config default).
fn read_rope_theta(f: &Fields) -> Result<f64> {
    let (theta, partial) = read_rope(f)?;
    if let Some(p) = partial {
        if p != 1.0 {
            return Err(f.invalid(
                "partial_rotary_factor",
                format!("is {p}; only full-width RoPE (1.0) is implemented for this model type"),
            ));
        }
    }
    Ok(theta.unwrap_or(1e6))
}

/// The fields every supported target shares: the decoder shape. `default_head_dim` is the model
/// family's default when `head_dim` is absent (None: `hidden_size / num_attention_heads`).
struct CommonShape {
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    intermediate_size: usize,
    rms_norm_eps: f64,
}

fn read_common_shape(f: &Fields, default_head_dim: Option<usize>, hint: &'static str) -> Result<CommonShape> {
    let hidden_size = f.req_positive("hidden_size", hint)?;
    let num_hidden_layers = f.req_positive("num_hidden_layers", hint)?;
    let num_attention_heads = f.req_positive("num_attention_heads", hint)?;
    let intermediate_size = f.req_positive("intermediate_size", hint)?;
    let vocab_size = f.req_positive("vocab_size", hint)?;
    // Absent means multi-head attention, as in transformers.
    let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
    let head_dim = match (f.opt_usize("head_dim")?, default_head_dim) {
        (Some(hd), _) | (None, Some(hd)) => hd,
        (None, None) if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
        (None, None) => {
            return Err(f.invalid(
                "head_dim",
                format!(
                    "is absent and hidden_size {hidden_size} is not a multiple of \
                     num_attention_heads {num_attention_heads}; set head_dim explicitly"
                ),
            ))
        }
    };
    if f.opt_bool("use_sliding_window")? == Some(true) {
        return Err(f.invalid(
            "use_sliding_window",
            "is true; sliding-window attention is not implemented (Qwen3 dense checkpoints \
             ship with it off)",
        ));
    }
    if let Some(act) = f.opt_str("hidden_act")? {
        if act != "silu" {
            return Err(f.invalid("hidden_act", format!("is \"{act}\"; only \"silu\" (SwiGLU) is implemented")));
        }
    }
    if f.opt_bool("attention_bias")? == Some(true) {
        return Err(f.invalid("attention_bias", "is true; attention biases are not implemented (Qwen3 has none)"));
    }
    Ok(CommonShape {
        vocab_size,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size,
        rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
    })
}

/// Refuses a drafter checkpoint's config where a target's is expected.
fn refuse_drafter(f: &Fields, architectures: &[String]) -> Result<()> {
    if architectures.iter().any(|a| a == "DFlashDraftModel") {
        return Err(f.invalid(
            "architectures",
            "names a DFlash drafter (DFlashDraftModel); point the target path at the target \
             model's folder, not at a drafter checkpoint",
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Architecture families
// ---------------------------------------------------------------------------------------------

/// The token mixer of one Qwen3.5/3.6 decoder layer (`layer_types[i]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`"linear_attention"`).
    Linear,
    /// Gated full attention (`"full_attention"`).
    Full,
}

impl LayerType {
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerType::Linear => "linear_attention",
            LayerType::Full => "full_attention",
        }
    }
}

/// What a Qwen3.5/3.6 hybrid target adds to the shared decoder shape (QWEN35.md section 1). The
/// full-attention layers use the shared `num_attention_heads`, `num_key_value_heads` and
/// `head_dim`, with the sigmoid output gate (`q_proj` has `2 * nq * hd` rows).
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    pub layer_types: Vec<LayerType>,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    /// Fraction of each full-attention head that RoPE rotates (0.25: 64 of 256 dims).
    pub partial_rotary_factor: f64,
}

impl HybridConfig {
    /// `Kd = HK * dk`: width of the query and of the key part of `in_proj_qkv`.
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// `Vd = HV * dv`.
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the depthwise convolution, `2 * Kd + Vd` (q | k | v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Dims of a full-attention head that rotate, `head_dim * partial_rotary_factor`.
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor).round() as usize
    }
    /// The layer types transformers derives when a config lists none: every `interval`-th layer
    /// (`i % interval == interval - 1`) is full attention.
    pub fn default_layer_types(num_layers: usize, interval: usize) -> Vec<LayerType> {
        (0..num_layers).map(|i| if (i + 1) % interval == 0 { LayerType::Full } else { LayerType::Linear }).collect()
    }
}

/// The architecture family of a target; the model code asks this instead of the model type.
#[derive(Clone, Debug, PartialEq)]
pub enum Arch {
    /// Qwen3 dense: plain-`w` RMSNorm, GQA with QK-norm and full RoPE, SwiGLU.
    Qwen3,
    /// Qwen3.5/3.6 dense hybrid: Gated DeltaNet and gated full attention, `1 + w` norms.
    Qwen35(HybridConfig),
}

// ---------------------------------------------------------------------------------------------
// The target
// ---------------------------------------------------------------------------------------------

/// The frozen target: the Qwen3 dense subset of a Hugging Face `config.json`.
///
/// (De)serialises through [`TargetConfig::to_hf_value`] / the validating reader, so a config
/// embedded in another serde struct is checked exactly like one read from a file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub struct TargetConfig {
    pub model_type: String,
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// True when `lm_head` is the embedding matrix (no `lm_head.weight` in the checkpoint).
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    /// Hugging Face allows one id or a list; empty when absent.
    pub eos_token_id: Vec<u32>,
    /// The embedding row used for the drafter's mask slots, when the config names one.
    pub mask_token_id: Option<u32>,
    /// The architecture family and what it adds to the shape above.
    pub arch: Arch,
}

impl TargetConfig {
    /// Reads and validates a Hugging Face `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_json_with_source(&read_text(path)?, &path.display().to_string())
    }

    /// Parses and validates config JSON held in memory.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_json_with_source(text, FROM_STRING)
    }

    fn from_json_with_source(text: &str, file: &str) -> Result<Self> {
        Self::from_map(&parse_object(text, file)?, file)
    }

    fn from_map(map: &Map<String, Value>, file: &str) -> Result<Self> {
        let f = Fields { file, map };
        let model_type = f.opt_str("model_type")?.ok_or(ConfigError::MissingField {
            file: file.to_string(),
            field: "model_type",
            hint: "a Qwen3 config.json has \"model_type\": \"qwen3\" (Qwen3.5/3.6: \"qwen3_5\")",
        })?;
        match model_type {
            "qwen3" => Self::read_qwen3(&f),
            // The vision-language wrapper: the text model's fields sit under `text_config`.
            "qwen3_5" => {
                let text = f.opt_object("text_config")?.ok_or(ConfigError::MissingField {
                    file: file.to_string(),
                    field: "text_config",
                    hint: "a Qwen3.5/3.6 vision-language config.json (model_type \"qwen3_5\") nests the \
                           text model under text_config",
                })?;
                if let Some(inner) = text.opt_str("model_type")? {
                    if inner != "qwen3_5_text" {
                        return Err(ConfigError::UnsupportedModel {
                            file: file.to_string(),
                            model_type: format!("{inner} (text_config)"),
                        });
                    }
                }
                Self::read_qwen35(&text, Some(&f))
            }
            "qwen3_5_text" => Self::read_qwen35(&f, None),
            other => Err(ConfigError::UnsupportedModel { file: file.to_string(), model_type: other.to_string() }),
        }
    }

    fn read_qwen3(f: &Fields) -> Result<Self> {
        let architectures = f.opt_str_list("architectures")?;
        refuse_drafter(f, &architectures)?;
        let c = read_common_shape(f, None, "every Qwen3 config.json has it; is this the right file?")?;
        let cfg = TargetConfig {
            model_type: "qwen3".to_string(),
            architectures,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: read_rope_theta(f)?,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            // transformers' Qwen3Config default; it bounds nothing in training.
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(32_768),
            bos_token_id: f.opt_u32("bos_token_id")?,
            eos_token_id: f.opt_u32_list("eos_token_id")?,
            mask_token_id: f.opt_u32("mask_token_id")?,
            arch: Arch::Qwen3,
        };
        cfg.validate_in(f.file)?;
        Ok(cfg)
    }

    /// A Qwen3.5/3.6 text config: `f` is the flat text-only file, or the `text_config` object of
    /// a vision-language wrapper `outer` (whose top level may hold `architectures`,
    /// `tie_word_embeddings` and token ids). Defaults are transformers' `Qwen3_5TextConfig`'s.
    fn read_qwen35(f: &Fields, outer: Option<&Fields>) -> Result<Self> {
        let architectures = match outer {
            Some(o) => o.opt_str_list("architectures")?,
            None => f.opt_str_list("architectures")?,
        };
        refuse_drafter(f, &architectures)?;
        let c = read_common_shape(f, Some(256), "every Qwen3.5/3.6 text config has it; is this the right file?")?;
        let (theta, partial) = read_rope(f)?;
        let rope_theta = theta.ok_or(ConfigError::MissingField {
            file: f.file.to_string(),
            field: "rope_parameters.rope_theta",
            hint: "Qwen3.5/3.6 configs give it in rope_parameters (older files: top-level rope_theta)",
        })?;
        let layer_types = match f.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerType::Linear),
                    Some("full_attention") => Ok(LayerType::Full),
                    _ => Err(f.invalid(
                        "layer_types",
                        format!(
                            "entry {i} is {v}; each entry must be \"linear_attention\" or \"full_attention\" \
                             (other layer types are not implemented)"
                        ),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(v) => return Err(f.invalid("layer_types", format!("must be a list of strings, found {v}"))),
            None => {
                let interval = f.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(f.invalid("full_attention_interval", "is 0; it must be positive"));
                }
                HybridConfig::default_layer_types(c.num_hidden_layers, interval)
            }
        };
        if f.opt_bool("attn_output_gate")? == Some(false) {
            return Err(f.invalid(
                "attn_output_gate",
                "is false; Qwen3.5/3.6 full attention always has the sigmoid output gate (q_proj with \
                 2 * heads * head_dim rows), an ungated variant is not implemented",
            ));
        }
        let hybrid = HybridConfig {
            layer_types,
            linear_num_key_heads: f.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            linear_num_value_heads: f.opt_usize("linear_num_value_heads")?.unwrap_or(32),
            linear_key_head_dim: f.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            linear_value_head_dim: f.opt_usize("linear_value_head_dim")?.unwrap_or(128),
            linear_conv_kernel_dim: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            partial_rotary_factor: partial.unwrap_or(0.25),
        };
        // Fields the wrapper may hold at its top level instead of in text_config.
        let either_bool = |field: &'static str| -> Result<Option<bool>> {
            match outer {
                Some(o) => Ok(o.opt_bool(field)?.or(f.opt_bool(field)?)),
                None => f.opt_bool(field),
            }
        };
        let either_u32 = |field: &'static str| -> Result<Option<u32>> {
            match (f.opt_u32(field)?, outer) {
                (Some(x), _) => Ok(Some(x)),
                (None, Some(o)) => o.opt_u32(field),
                (None, None) => Ok(None),
            }
        };
        let mut eos_token_id = f.opt_u32_list("eos_token_id")?;
        if let (true, Some(o)) = (eos_token_id.is_empty(), outer) {
            eos_token_id = o.opt_u32_list("eos_token_id")?;
        }
        let cfg = TargetConfig {
            model_type: "qwen3_5_text".to_string(),
            architectures,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta,
            tie_word_embeddings: either_bool("tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(32_768),
            bos_token_id: either_u32("bos_token_id")?,
            eos_token_id,
            mask_token_id: either_u32("mask_token_id")?,
            arch: Arch::Qwen35(hybrid),
        };
        cfg.validate_in(f.file)?;
        Ok(cfg)
    }

    /// Checks the invariants every consumer relies on. Presets and parsed files pass through it.
    pub fn validate(&self) -> Result<()> {
        self.validate_in("<target config>")
    }

    fn validate_in(&self, file: &str) -> Result<()> {
        let invalid =
            |field: &'static str, reason: String| ConfigError::InvalidField { file: file.to_string(), field, reason };
        let family_type = match self.arch {
            Arch::Qwen3 => "qwen3",
            Arch::Qwen35(_) => "qwen3_5_text",
        };
        if self.model_type != family_type {
            return Err(ConfigError::UnsupportedModel { file: file.to_string(), model_type: self.model_type.clone() });
        }
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(invalid(field, "is 0; it must be positive".to_string()));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(ConfigError::HeadsNotDivisible {
                file: file.to_string(),
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
            });
        }
        if self.head_dim % 2 != 0 {
            return Err(invalid(
                "head_dim",
                format!("is {}; rotate-half RoPE pairs dimension i with i + hd/2, so it must be even", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                format!("is {}; it must be a small positive number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid("rope_theta", format!("is {}; it must be positive", self.rope_theta)));
        }
        let in_vocab = |field: &'static str, id: u32| {
            if id as usize >= self.vocab_size {
                Err(invalid(field, format!("({id}) is not below vocab_size ({})", self.vocab_size)))
            } else {
                Ok(())
            }
        };
        if let Some(id) = self.mask_token_id {
            in_vocab("mask_token_id", id)?;
        }
        if let Some(id) = self.bos_token_id {
            in_vocab("bos_token_id", id)?;
        }
        for &id in &self.eos_token_id {
            in_vocab("eos_token_id", id)?;
        }
        match &self.arch {
            Arch::Qwen3 => Ok(()),
            Arch::Qwen35(hy) => self.validate_hybrid(hy, file),
        }
    }

    fn validate_hybrid(&self, hy: &HybridConfig, file: &str) -> Result<()> {
        let invalid =
            |field: &'static str, reason: String| ConfigError::InvalidField { file: file.to_string(), field, reason };
        if hy.layer_types.len() != self.num_hidden_layers {
            return Err(invalid(
                "layer_types",
                format!(
                    "lists {} layers but num_hidden_layers is {}; give one entry per layer",
                    hy.layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        for (field, v) in [
            ("linear_num_key_heads", hy.linear_num_key_heads),
            ("linear_num_value_heads", hy.linear_num_value_heads),
            ("linear_key_head_dim", hy.linear_key_head_dim),
            ("linear_value_head_dim", hy.linear_value_head_dim),
            ("linear_conv_kernel_dim", hy.linear_conv_kernel_dim),
        ] {
            if v == 0 {
                return Err(invalid(field, "is 0; it must be positive".to_string()));
            }
        }
        if hy.linear_num_value_heads % hy.linear_num_key_heads != 0 {
            return Err(invalid(
                "linear_num_value_heads",
                format!(
                    "({}) is not a multiple of linear_num_key_heads ({}); each key head must serve the same \
                     number of value heads",
                    hy.linear_num_value_heads, hy.linear_num_key_heads
                ),
            ));
        }
        let rot = hy.rotary_dim(self.head_dim);
        let exact = self.head_dim as f64 * hy.partial_rotary_factor;
        if rot == 0 || rot % 2 != 0 || (exact - rot as f64).abs() > 1e-9 {
            return Err(invalid(
                "partial_rotary_factor",
                format!(
                    "({}) times head_dim {} gives {exact} rotating dims; it must be a positive even whole number",
                    hy.partial_rotary_factor, self.head_dim
                ),
            ));
        }
        Ok(())
    }

    /// A named shape for random-initialised targets: `tiny` (tests, CPU), `small` (CPU runs that
    /// learn something), `qwen3-8b-shape` (Qwen3-8B's exact shape, for GPU benchmarks), and the
    /// Qwen3.5/3.6 hybrids `qwen3.5-tiny` (8 layers, 2 of them full attention; trains on the CPU
    /// in minutes), `qwen3.5-small` (GPU tests) and `qwen3.6-27b-shape` (QWEN35.md section 1).
    ///
    /// Special tokens of the tiny and small presets sit at the top of the vocabulary like Qwen3's
    /// do: bos = V-3, eos = V-2, mask = V-1, so ids `0..V-3` are ordinary tokens.
    pub fn preset(name: &str) -> Result<Self> {
        let base = |vocab: usize, hidden, layers, heads, kv, hd, inter| TargetConfig {
            model_type: "qwen3".to_string(),
            architectures: vec!["Qwen3ForCausalLM".to_string()],
            vocab_size: vocab,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: hd,
            intermediate_size: inter,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            tie_word_embeddings: false,
            max_position_embeddings: 4096,
            bos_token_id: Some(vocab as u32 - 3),
            eos_token_id: vec![vocab as u32 - 2],
            mask_token_id: Some(vocab as u32 - 1),
            arch: Arch::Qwen3,
        };
        // Linear-attention heads (key, value) and head dims (key, value), conv kernel 4, a quarter
        // of each full-attention head rotating, every 4th layer full attention.
        let hybrid = |cfg: TargetConfig, hk, hv, dk, dv| TargetConfig {
            model_type: "qwen3_5_text".to_string(),
            architectures: vec!["Qwen3_5ForCausalLM".to_string()],
            rope_theta: 1e7,
            arch: Arch::Qwen35(HybridConfig {
                layer_types: HybridConfig::default_layer_types(cfg.num_hidden_layers, 4),
                linear_num_key_heads: hk,
                linear_num_value_heads: hv,
                linear_key_head_dim: dk,
                linear_value_head_dim: dv,
                linear_conv_kernel_dim: 4,
                partial_rotary_factor: 0.25,
            }),
            ..cfg
        };
        let cfg = match name {
            "tiny" => base(256, 64, 6, 4, 2, 16, 192),
            "small" => base(4096, 256, 8, 8, 4, 32, 768),
            "qwen3-8b-shape" => TargetConfig {
                max_position_embeddings: 40_960,
                bos_token_id: Some(151_643), // <|endoftext|>
                eos_token_id: vec![151_645], // <|im_end|>
                mask_token_id: Some(QWEN3_MASK_TOKEN_ID),
                ..base(QWEN3_VOCAB_SIZE, 4096, 36, 32, 8, 128, 12_288)
            },
            "qwen3.5-tiny" => hybrid(base(256, 64, 8, 4, 2, 16, 192), 2, 4, 16, 16),
            "qwen3.5-small" => hybrid(base(4096, 256, 8, 8, 2, 64, 768), 4, 8, 32, 32),
            "qwen3.6-27b-shape" => TargetConfig {
                max_position_embeddings: 262_144,
                bos_token_id: None,
                eos_token_id: Vec::new(),
                mask_token_id: Some(QWEN35_MASK_TOKEN_ID),
                ..hybrid(base(QWEN35_VOCAB_SIZE, 5120, 64, 24, 4, 256, 17_408), 16, 48, 128, 128)
            },
            _ => return Err(ConfigError::UnknownPreset { name: name.to_string() }),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The hybrid fields of a Qwen3.5/3.6 target (None for Qwen3 dense).
    pub fn hybrid(&self) -> Option<&HybridConfig> {
        match &self.arch {
            Arch::Qwen3 => None,
            Arch::Qwen35(hy) => Some(hy),
        }
    }

    pub fn layer_dims(&self) -> LayerDims {
        LayerDims {
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate_size,
        }
    }

    /// Total parameter count (embedding, layers, final norm, and lm_head unless tied).
    pub fn num_params(&self) -> u64 {
        let vh = self.vocab_size as u64 * self.hidden_size as u64;
        let head = if self.tie_word_embeddings { 0 } else { vh };
        let layers = match &self.arch {
            Arch::Qwen3 => self.num_hidden_layers as u64 * self.layer_dims().params_per_layer(),
            Arch::Qwen35(hy) => {
                let d = self.layer_dims();
                let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
                let shared = 3 * i * h + 2 * h; // MLP and the two layer norms
                let (q, kv, hd) = (d.q_dim() as u64, d.kv_dim() as u64, d.head_dim as u64);
                // q_proj has the gate rows too: 2 * nq * hd.
                let full = 2 * q * h + 2 * kv * h + h * q + 2 * hd;
                let (c, vd, hv) = (hy.conv_dim() as u64, hy.value_dim() as u64, hy.linear_num_value_heads as u64);
                let k = hy.linear_conv_kernel_dim as u64;
                let linear = c * h + vd * h + 2 * hv * h + c * k + 2 * hv + hy.linear_value_head_dim as u64 + h * vd;
                hy.layer_types.iter().map(|t| shared + if *t == LayerType::Full { full } else { linear }).sum()
            }
        };
        vh + head + layers + self.hidden_size as u64
    }

    /// The mask token the drafter uses: the config's `mask_token_id`, else Qwen3's 151669 when the
    /// vocabulary is Qwen3's (real Qwen3 checkpoints do not name one), else an error.
    pub fn resolved_mask_token_id(&self) -> Result<u32> {
        match self.mask_token_id {
            Some(id) => Ok(id),
            None if self.vocab_size == QWEN3_VOCAB_SIZE => Ok(QWEN3_MASK_TOKEN_ID),
            None if self.vocab_size == QWEN35_VOCAB_SIZE => Ok(QWEN35_MASK_TOKEN_ID),
            None => Err(ConfigError::NoMaskToken { vocab_size: self.vocab_size }),
        }
    }

    /// A `config.json` that transformers 5 `Qwen3ForCausalLM.from_pretrained` loads (and 4.5x
    /// too: both `rope_theta` and `rope_parameters` are written, and `dtype` and `torch_dtype`);
    /// for a Qwen3.5/3.6 target, the flat text-only layout `Qwen3_5ForCausalLM` loads.
    pub fn to_hf_value(&self) -> Value {
        if let Arch::Qwen35(hy) = &self.arch {
            return self.to_hf_value_qwen35(hy);
        }
        let mut v = json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos_json(&self.eos_token_id),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "sliding_window": null,
            "use_sliding_window": false,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "use_cache": true,
            "vocab_size": self.vocab_size,
        });
        if let (Some(id), Value::Object(map)) = (self.mask_token_id, &mut v) {
            map.insert("mask_token_id".to_string(), json!(id));
        }
        v
    }

    /// The flat text-only Qwen3.5/3.6 config (`Qwen3_5ForCausalLM`, model_type
    /// "qwen3_5_text"), as `save_pretrained` writes one for a text config.
    fn to_hf_value_qwen35(&self, hy: &HybridConfig) -> Value {
        let layer_types: Vec<&str> = hy.layer_types.iter().map(|t| t.hf_name()).collect();
        let mut v = json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "attn_output_gate": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos_json(&self.eos_token_id),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": layer_types,
            "linear_conv_kernel_dim": hy.linear_conv_kernel_dim,
            "linear_key_head_dim": hy.linear_key_head_dim,
            "linear_num_key_heads": hy.linear_num_key_heads,
            "linear_num_value_heads": hy.linear_num_value_heads,
            "linear_value_head_dim": hy.linear_value_head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": hy.partial_rotary_factor,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "use_cache": true,
            "vocab_size": self.vocab_size,
        });
        if let (Some(id), Value::Object(map)) = (self.mask_token_id, &mut v) {
            map.insert("mask_token_id".to_string(), json!(id));
        }
        v
    }

    /// [`TargetConfig::to_hf_value`] as pretty-printed JSON text.
    pub fn to_hf_json(&self) -> String {
        pretty(&self.to_hf_value())
    }
}

fn eos_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

fn pretty(v: &Value) -> String {
    // Serialising a Value cannot fail (all keys are strings).
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s
}

impl TryFrom<Value> for TargetConfig {
    type Error = ConfigError;
    fn try_from(v: Value) -> Result<Self> {
        match v {
            Value::Object(map) => Self::from_map(&map, FROM_STRING),
            _ => Err(ConfigError::InvalidField {
                file: FROM_STRING.to_string(),
                field: "<root>",
                reason: "must be a JSON object".to_string(),
            }),
        }
    }
}

impl From<TargetConfig> for Value {
    fn from(cfg: TargetConfig) -> Value {
        cfg.to_hf_value()
    }
}

// ---------------------------------------------------------------------------------------------
// Tap layers
// ---------------------------------------------------------------------------------------------

/// The default target layers to tap (DFLASH.md section 1): `n == 1 -> [L / 2]`, else
/// `round_ties_even(1 + i * (L - 4) / (n - 1))` for i in 0..n, the rule public DFlash drafters use.
/// Python's `round` is ties-to-even, hence `round_ties_even`; the expression is evaluated in the
/// same order as the Python (`i * span` exact, then one division, then `+ 1`), so ties land on the
/// same side. Requires `L >= 4` when `n > 1` ([`resolve_tap_layers`] turns that into an error;
/// here smaller `L` is clamped into `0..L`). `n == 0` gives an empty list.
pub fn default_tap_layers(num_target_layers: usize, n: usize) -> Vec<usize> {
    let l = num_target_layers;
    match n {
        0 => Vec::new(),
        1 => vec![l / 2],
        _ => (0..n)
            .map(|i| {
                let x = 1.0 + (i as f64 * (l as f64 - 4.0)) / (n as f64 - 1.0);
                (x.round_ties_even().max(0.0) as usize).min(l.saturating_sub(1))
            })
            .collect(),
    }
}

/// Checks tap ids against the target depth: non-empty, ascending, each `< L`. Repeats are
/// allowed because the default rule produces them when `n > L - 3` (e.g. L=4 gives [1, 1]).
pub fn validate_tap_layers(num_target_layers: usize, ids: &[usize]) -> Result<()> {
    if ids.is_empty() {
        return Err(ConfigError::NoTaps);
    }
    if let Some(&id) = ids.iter().find(|&&id| id >= num_target_layers) {
        return Err(ConfigError::TapOutOfRange { id, num_layers: num_target_layers });
    }
    if ids.windows(2).any(|w| w[0] > w[1]) {
        return Err(ConfigError::TapsNotSorted { ids: ids.to_vec() });
    }
    Ok(())
}

/// Explicit taps if given (validated), else the default rule for `n` taps, which needs `L >= 4`
/// when `n > 1`.
pub fn resolve_tap_layers(num_target_layers: usize, n: usize, explicit: Option<Vec<usize>>) -> Result<Vec<usize>> {
    let ids = match explicit {
        Some(ids) => ids,
        None if n > 1 && num_target_layers < 4 => {
            return Err(ConfigError::TooFewLayersForDefaultTaps { num_layers: num_target_layers, n })
        }
        None => default_tap_layers(num_target_layers, n),
    };
    validate_tap_layers(num_target_layers, &ids)?;
    Ok(ids)
}

// ---------------------------------------------------------------------------------------------
// The drafter
// ---------------------------------------------------------------------------------------------

/// Decay of the per-slot loss weight `exp(-(r-1)/gamma)` (DFLASH.md section 4).
/// `gamma = 1 + 3 * bs / 8`: the straight line through the two published values (7 at block size
/// 16, 4 at block size 8), so other block sizes interpolate/extrapolate between them
/// (bs 4 -> 2.5, bs 32 -> 13).
pub fn default_gamma(block_size: usize) -> f64 {
    1.0 + 3.0 * block_size as f64 / 8.0
}

/// The first field in which two drafter configs differ ([`DrafterConfig::first_difference`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigDifference {
    /// The field as config.json spells it.
    pub field: &'static str,
    pub ours: String,
    pub theirs: String,
    /// The drafter takes this field from its target (hidden size, vocabulary, mask token), so a
    /// difference means another target, not other drafter settings.
    pub from_target: bool,
}

/// The drafter: Qwen3 layers with KV injection (DFLASH.md section 3). It inherits the target's
/// layer shape, vocabulary and RoPE, because it borrows the target's embedding and lm_head.
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterConfig {
    pub num_layers: usize,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// 0-based target layers whose output residual stream is tapped, in packing order.
    pub target_layer_ids: Vec<usize>,
    /// Depth of the target the taps refer to (written to the checkpoint as `num_target_layers`).
    pub num_target_layers: usize,
    /// Loss-weight decay over block slots; see [`default_gamma`].
    pub gamma: f64,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    /// The attention kind of each layer (config `layer_types`, one per layer).
    pub layer_types: Vec<DraftLayerType>,
    /// The window of the sliding layers (`sliding_window`); `None` when no layer slides.
    pub sliding_window: Option<usize>,
}

/// A drafter layer's attention (DFLASH.md section 3, "Per-layer attention kind").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLayerType {
    /// `"full_attention"`: the whole context before the anchor, the whole block.
    Full,
    /// `"sliding_attention"`: the last `sliding_window` positions, causal inside the block.
    Sliding,
}

impl DraftLayerType {
    pub fn hf_name(self) -> &'static str {
        match self {
            DraftLayerType::Full => "full_attention",
            DraftLayerType::Sliding => "sliding_attention",
        }
    }
}

/// The built-in drafter recipes (`--drafter-config NAME`): the published DFlash drafter shapes.
pub const RECIPE_NAMES: [&str; 2] = ["qwen3-8b", "qwen3.6-27b"];

impl DrafterConfig {
    /// A published drafter shape by name ([`RECIPE_NAMES`]): `qwen3-8b` (SpecForge
    /// `configs/qwen3-8b-dflash.json`: the target's geometry, 5 full layers) and `qwen3.6-27b`
    /// (`configs/qwen3.6-27b-dflash.json`: H 5120, 32 x 128 query heads, 8 KV heads, MLP 17408,
    /// 4 sliding layers of window 2048 then 1 full layer, RoPE theta 1e7, mask token 248070).
    pub fn recipe(name: &str) -> Result<Self> {
        #[allow(clippy::too_many_arguments)]
        fn base(
            hidden: usize,
            inter: usize,
            vocab: usize,
            target_layers: usize,
            theta: f64,
            mask: u32,
            max_pos: usize,
        ) -> DrafterConfig {
            DrafterConfig {
                num_layers: 5,
                block_size: 16,
                mask_token_id: mask,
                target_layer_ids: default_tap_layers(target_layers, 5),
                num_target_layers: target_layers,
                gamma: default_gamma(16),
                hidden_size: hidden,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 128,
                intermediate_size: inter,
                vocab_size: vocab,
                rms_norm_eps: 1e-6,
                rope_theta: theta,
                max_position_embeddings: max_pos,
                bos_token_id: None,
                eos_token_id: Vec::new(),
                layer_types: vec![DraftLayerType::Full; 5],
                sliding_window: None,
            }
        }
        let cfg = match name {
            "qwen3-8b" => DrafterConfig {
                bos_token_id: Some(151_643),
                eos_token_id: vec![151_645],
                ..base(4096, 12_288, QWEN3_VOCAB_SIZE, 36, 1e6, 151_669, 40_960)
            },
            "qwen3.6-27b" => DrafterConfig {
                layer_types: [[DraftLayerType::Sliding; 4].as_slice(), &[DraftLayerType::Full]].concat(),
                sliding_window: Some(2048),
                ..base(5120, 17_408, 248_320, 64, 1e7, 248_070, 262_144)
            },
            _ => return Err(ConfigError::UnknownRecipe { name: name.to_string() }),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A recipe name, a config.json path or a folder holding one, as `--drafter-config` takes
    /// it: an existing file or folder wins over a recipe of the same name.
    pub fn from_name_or_file(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_file() {
            return Self::from_file(path);
        }
        if path.is_dir() && path.join("config.json").is_file() {
            return Self::from_file(path.join("config.json"));
        }
        Self::recipe(spec)
    }

    /// Whether any layer slides (then `sliding_window` is set).
    pub fn any_sliding(&self) -> bool {
        self.layer_types.contains(&DraftLayerType::Sliding)
    }

    /// The attention window of layer `l`: `None` for a full layer.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match self.layer_types.get(l) {
            Some(DraftLayerType::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// The first field where `other` (e.g. a warm start's checkpoint config) describes another
    /// drafter than `self`: geometry, layer kinds,
    /// window, taps, block size, mask token, norm eps and RoPE. Training settings (the loss
    /// gamma) and token ids other than the mask may differ.
    pub fn first_difference(&self, other: &DrafterConfig) -> Option<ConfigDifference> {
        // (field, self's value, other's value, whether the drafter takes the field from its target)
        let pairs: [(&'static str, String, String, bool); 14] = [
            ("hidden_size", self.hidden_size.to_string(), other.hidden_size.to_string(), true),
            ("num_hidden_layers", self.num_layers.to_string(), other.num_layers.to_string(), false),
            ("num_attention_heads", self.num_attention_heads.to_string(), other.num_attention_heads.to_string(), false),
            ("num_key_value_heads", self.num_key_value_heads.to_string(), other.num_key_value_heads.to_string(), false),
            ("head_dim", self.head_dim.to_string(), other.head_dim.to_string(), false),
            ("intermediate_size", self.intermediate_size.to_string(), other.intermediate_size.to_string(), false),
            ("vocab_size", self.vocab_size.to_string(), other.vocab_size.to_string(), true),
            ("block_size", self.block_size.to_string(), other.block_size.to_string(), false),
            (
                "dflash_config.target_layer_ids",
                format!("{:?}", self.target_layer_ids),
                format!("{:?}", other.target_layer_ids),
                false,
            ),
            ("dflash_config.mask_token_id", self.mask_token_id.to_string(), other.mask_token_id.to_string(), true),
            ("layer_types", format!("{:?}", self.layer_type_names()), format!("{:?}", other.layer_type_names()), false),
            ("sliding_window", format!("{:?}", self.sliding_window), format!("{:?}", other.sliding_window), false),
            ("rms_norm_eps", self.rms_norm_eps.to_string(), other.rms_norm_eps.to_string(), false),
            ("rope_theta", self.rope_theta.to_string(), other.rope_theta.to_string(), false),
        ];
        pairs.into_iter().find(|(_, a, b, _)| a != b).map(|(field, ours, theirs, from_target)| ConfigDifference {
            field,
            ours,
            theirs,
            from_target,
        })
    }

    /// `layer_types` as the config spells them.
    pub fn layer_type_names(&self) -> Vec<&'static str> {
        self.layer_types.iter().map(|t| t.hf_name()).collect()
    }

    /// A drafter for `target`. `taps: None` uses [`default_tap_layers`] with `n = num_layers`.
    /// The mask token comes from [`TargetConfig::resolved_mask_token_id`]; change the field
    /// afterwards (and call [`DrafterConfig::validate`]) to override it.
    pub fn for_target(
        target: &TargetConfig,
        num_layers: usize,
        block_size: usize,
        taps: Option<Vec<usize>>,
    ) -> Result<Self> {
        if num_layers == 0 {
            // Checked first: with zero layers the default rule would report "no taps" instead.
            return Err(ConfigError::InvalidDrafter {
                field: "num_layers",
                reason: "is 0; a drafter needs at least one layer".into(),
            });
        }
        let cfg = DrafterConfig {
            num_layers,
            block_size,
            mask_token_id: target.resolved_mask_token_id()?,
            target_layer_ids: resolve_tap_layers(target.num_hidden_layers, num_layers, taps)?,
            num_target_layers: target.num_hidden_layers,
            gamma: default_gamma(block_size),
            hidden_size: target.hidden_size,
            num_attention_heads: target.num_attention_heads,
            num_key_value_heads: target.num_key_value_heads,
            head_dim: target.head_dim,
            intermediate_size: target.intermediate_size,
            vocab_size: target.vocab_size,
            rms_norm_eps: target.rms_norm_eps,
            rope_theta: target.rope_theta,
            max_position_embeddings: target.max_position_embeddings,
            bos_token_id: target.bos_token_id,
            eos_token_id: target.eos_token_id.clone(),
            layer_types: vec![DraftLayerType::Full; num_layers],
            sliding_window: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| ConfigError::InvalidDrafter { field, reason };
        if self.num_layers == 0 {
            return Err(bad("num_layers", "is 0; a drafter needs at least one layer".into()));
        }
        if self.block_size < 2 {
            return Err(bad(
                "block_size",
                format!("is {}; it must be >= 2 (slot 0 is the anchor, only slots 1.. are predicted)", self.block_size),
            ));
        }
        if !(self.gamma.is_finite() && self.gamma > 0.0) {
            return Err(bad("gamma", format!("is {}; it must be positive", self.gamma)));
        }
        if self.mask_token_id as usize >= self.vocab_size {
            return Err(bad(
                "mask_token_id",
                format!("({}) is not below vocab_size ({})", self.mask_token_id, self.vocab_size),
            ));
        }
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(bad(field, "is 0; it must be positive".into()));
            }
        }
        if self.layer_types.len() != self.num_layers {
            return Err(bad(
                "layer_types",
                format!("lists {} layers but num_hidden_layers is {}", self.layer_types.len(), self.num_layers),
            ));
        }
        if self.any_sliding() && self.sliding_window.is_none_or(|w| w < 1) {
            return Err(bad(
                "sliding_window",
                "is missing or 0, but layer_types has sliding_attention layers: set it to the window (e.g. 2048)"
                    .into(),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad("rms_norm_eps", format!("is {}; it must be a positive number", self.rms_norm_eps)));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(bad(
                "num_attention_heads",
                format!(
                    "({}) is not a multiple of num_key_value_heads ({})",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        validate_tap_layers(self.num_target_layers, &self.target_layer_ids)
    }

    /// Number of tapped layers `K`; the FC input width is `K * hidden_size`.
    pub fn num_taps(&self) -> usize {
        self.target_layer_ids.len()
    }

    pub fn layer_dims(&self) -> LayerDims {
        LayerDims {
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate_size,
        }
    }

    /// Trained parameters: fc, hidden_norm, the layers and the final norm (embedding and lm_head
    /// are the target's, frozen, and not counted).
    pub fn num_params(&self) -> u64 {
        let h = self.hidden_size as u64;
        h * self.num_taps() as u64 * h + h + self.num_layers as u64 * self.layer_dims().params_per_layer() + h
    }

    /// Checks that this drafter (e.g. from a config file or a checkpoint) fits `target`: the
    /// hidden size and vocabulary (it borrows the target's embedding and lm_head), the target
    /// depth its taps were chosen for, and the tap range. The attention geometry, RoPE theta and
    /// norm eps are the drafter's own (DFLASH.md section 3).
    pub fn check_against_target(&self, target: &TargetConfig) -> Result<()> {
        let pairs = [
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("num_target_layers", self.num_target_layers, target.num_hidden_layers),
        ];
        for (field, d, t) in pairs {
            if d != t {
                return Err(ConfigError::TargetMismatch { field, drafter: d.to_string(), target: t.to_string() });
            }
        }
        if let Some(&id) = self.target_layer_ids.iter().find(|&&id| id >= target.num_hidden_layers) {
            return Err(ConfigError::TargetMismatch {
                field: "dflash_config.target_layer_ids",
                drafter: format!("{:?} (tap {id})", self.target_layer_ids),
                target: format!("{} layers (taps must be below it)", target.num_hidden_layers),
            });
        }
        validate_tap_layers(target.num_hidden_layers, &self.target_layer_ids)
    }

    /// The drafter checkpoint's `config.json`, in the layout public DFlash drafters use
    /// (`DFlashDraftModel`, Qwen3 shape fields with `num_hidden_layers` = drafter layers,
    /// `block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`).
    /// `dflash_config.loss_gamma` is ours (a training setting; loaders ignore unknown keys). No
    /// `auto_map` is written: loading it in transformers needs DFlash's modelling code supplied.
    pub fn to_json_value(&self) -> Value {
        json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos_json(&self.eos_token_id),
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
                "loss_gamma": self.gamma,
            },
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": self.layer_type_names(),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "sliding_window": if self.any_sliding() { json!(self.sliding_window) } else { Value::Null },
            "use_sliding_window": self.any_sliding(),
            "tie_word_embeddings": false,
            "use_cache": true,
            "vocab_size": self.vocab_size,
        })
    }

    /// [`DrafterConfig::to_json_value`] as pretty-printed JSON text.
    pub fn to_json(&self) -> String {
        pretty(&self.to_json_value())
    }

    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_json_with_source(&read_text(path)?, &path.display().to_string())
    }

    /// Reads a drafter `config.json` (ours or a public DFlash drafter's). Missing
    /// `target_layer_ids` fall back to the default rule, as the reference loader does.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_json_with_source(text, FROM_STRING)
    }

    fn from_json_with_source(text: &str, file: &str) -> Result<Self> {
        let map = parse_object(text, file)?;
        let f = Fields { file, map: &map };
        let architectures = f.opt_str_list("architectures")?;
        if !architectures.is_empty() && !architectures.iter().any(|a| a == "DFlashDraftModel") {
            return Err(f.invalid(
                "architectures",
                format!("is {architectures:?}, not a DFlash drafter (DFlashDraftModel); is this the target's config?"),
            ));
        }
        const HINT: &str = "a DFlash drafter config.json has it";
        let num_layers = f.req_positive("num_hidden_layers", HINT)?;
        let num_target_layers = f.req_positive("num_target_layers", HINT)?;
        let block_size = f.req_positive("block_size", HINT)?;
        let hidden_size = f.req_positive("hidden_size", HINT)?;
        let num_attention_heads = f.req_positive("num_attention_heads", HINT)?;
        let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(hd) => hd,
            None => hidden_size / num_attention_heads,
        };
        let dflash = f.opt_object("dflash_config")?.ok_or(ConfigError::MissingField {
            file: file.to_string(),
            field: "dflash_config",
            hint: "a DFlash drafter config.json has dflash_config {mask_token_id, target_layer_ids}",
        })?;
        let mask_token_id = dflash.opt_u32("mask_token_id")?.ok_or(ConfigError::MissingField {
            file: file.to_string(),
            field: "dflash_config.mask_token_id",
            hint: "the drafter cannot run without knowing its mask token",
        })?;
        let target_layer_ids = match dflash.get("target_layer_ids") {
            None => default_tap_layers(num_target_layers, num_layers),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|x| usize::try_from(x).ok()))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| f.invalid("dflash_config", "target_layer_ids must be a list of layer ids"))?,
            Some(_) => return Err(f.invalid("dflash_config", "target_layer_ids must be a list of layer ids")),
        };
        let layer_types = match f.get("layer_types") {
            None => vec![DraftLayerType::Full; num_layers],
            Some(_) => f
                .opt_str_list("layer_types")?
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(DraftLayerType::Full),
                    "sliding_attention" => Ok(DraftLayerType::Sliding),
                    other => Err(f.invalid(
                        "layer_types",
                        format!("has \"{other}\"; a drafter layer is full_attention or sliding_attention"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let any_sliding = layer_types.contains(&DraftLayerType::Sliding);
        if any_sliding && f.opt_bool("use_sliding_window")? == Some(false) {
            return Err(f.invalid(
                "use_sliding_window",
                "is false but layer_types has sliding_attention layers; serving engines read both, so they must agree",
            ));
        }
        let sliding_window = if any_sliding { f.opt_usize("sliding_window")? } else { None };
        let cfg = DrafterConfig {
            layer_types,
            sliding_window,
            num_layers,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers,
            gamma: dflash.opt_f64("loss_gamma")?.unwrap_or_else(|| default_gamma(block_size)),
            hidden_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size: f.req_positive("intermediate_size", HINT)?,
            vocab_size: f.req_positive("vocab_size", HINT)?,
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: read_rope_theta(&f)?,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(32_768),
            bos_token_id: f.opt_u32("bos_token_id")?,
            eos_token_id: f.opt_u32_list("eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Qwen3-8B config.json as transformers 4.5x writes it (top-level rope_theta).
    const QWEN3_8B_V4: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
      "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
      "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
      "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
    }"#;

    fn with(base: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        edit(v.as_object_mut().unwrap());
        v.to_string()
    }

    #[test]
    fn qwen3_8b_config_matches_preset_shape() {
        let cfg = TargetConfig::from_json_str(QWEN3_8B_V4).unwrap();
        let mut preset = TargetConfig::preset("qwen3-8b-shape").unwrap();
        preset.mask_token_id = None; // the HF file names none
        assert_eq!(cfg, preset);
        assert_eq!(cfg.resolved_mask_token_id().unwrap(), 151_669);
        // Qwen3-8B has 8.19 B parameters.
        assert_eq!(cfg.num_params(), 8_190_735_360);
    }

    #[test]
    fn transformers5_rope_parameters_are_read() {
        let text = with(QWEN3_8B_V4, |m| {
            m.remove("rope_theta");
            m.remove("rope_scaling");
            m.insert("rope_parameters".into(), json!({"rope_theta": 5e5, "rope_type": "default"}));
        });
        assert_eq!(TargetConfig::from_json_str(&text).unwrap().rope_theta, 5e5);
        // Neither spelling: Qwen3's default.
        let text = with(QWEN3_8B_V4, |m| {
            m.remove("rope_theta");
        });
        assert_eq!(TargetConfig::from_json_str(&text).unwrap().rope_theta, 1e6);
    }

    #[test]
    fn head_dim_and_kv_heads_defaults() {
        let text = with(QWEN3_8B_V4, |m| {
            m.remove("head_dim");
            m.remove("num_key_value_heads");
        });
        let cfg = TargetConfig::from_json_str(&text).unwrap();
        assert_eq!((cfg.head_dim, cfg.num_key_value_heads), (128, 32));
    }

    #[test]
    fn eos_list_is_accepted() {
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("eos_token_id".into(), json!([151645, 151643]));
        });
        assert_eq!(TargetConfig::from_json_str(&text).unwrap().eos_token_id, vec![151_645, 151_643]);
    }

    #[test]
    fn hf_json_round_trips_and_has_what_transformers_needs() {
        for name in PRESET_NAMES {
            let cfg = TargetConfig::preset(name).unwrap();
            let v = cfg.to_hf_value();
            if cfg.hybrid().is_some() {
                assert_eq!(v["architectures"], json!(["Qwen3_5ForCausalLM"]));
                assert_eq!(v["model_type"], "qwen3_5_text");
                assert_eq!(v["rope_parameters"]["partial_rotary_factor"], 0.25);
                assert_eq!(v["rope_parameters"]["rope_theta"], 1e7);
                assert_eq!(v["layer_types"].as_array().unwrap().len(), cfg.num_hidden_layers);
            } else {
                assert_eq!(v["architectures"], json!(["Qwen3ForCausalLM"]));
                assert_eq!(v["model_type"], "qwen3");
                assert_eq!(v["rope_parameters"]["rope_theta"], v["rope_theta"]);
            }
            assert_eq!(v["torch_dtype"], "bfloat16");
            assert_eq!(v["dtype"], "bfloat16");
            assert_eq!(v["hidden_act"], "silu");
            assert_eq!(v["attention_bias"], false);
            assert_eq!(v["rope_parameters"]["rope_type"], "default");
            assert_eq!(v["use_cache"], true);
            let back = TargetConfig::from_json_str(&cfg.to_hf_json()).unwrap();
            assert_eq!(back, cfg, "{name}");
            // Through serde as well (try_from / into).
            let via_serde: TargetConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
            assert_eq!(via_serde, cfg);
        }
    }

    #[test]
    fn presets_have_the_promised_shapes() {
        let t = TargetConfig::preset("tiny").unwrap();
        assert_eq!(
            (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads),
            (256, 64, 6, 4, 2)
        );
        assert_eq!((t.head_dim, t.intermediate_size, t.max_position_embeddings), (16, 192, 4096));
        assert_eq!((t.rms_norm_eps, t.rope_theta, t.tie_word_embeddings), (1e-6, 1e6, false));
        assert_eq!(t.mask_token_id, Some(255));
        let s = TargetConfig::preset("small").unwrap();
        assert_eq!(
            (s.vocab_size, s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads),
            (4096, 256, 8, 8, 4)
        );
        assert_eq!((s.head_dim, s.intermediate_size, s.tie_word_embeddings), (32, 768, false));
        assert_eq!(s.mask_token_id, Some(4095));
        let q = TargetConfig::preset("qwen3-8b-shape").unwrap();
        assert_eq!(q.mask_token_id, Some(151_669));
        assert_eq!(q.max_position_embeddings, 40_960);
    }

    #[test]
    fn unknown_preset_lists_valid_names() {
        let e = TargetConfig::preset("huge").unwrap_err();
        assert!(matches!(e, ConfigError::UnknownPreset { .. }));
        let msg = e.to_string();
        for name in PRESET_NAMES {
            assert!(msg.contains(name), "{msg}");
        }
    }

    #[test]
    fn missing_and_zero_fields_are_named() {
        let text = with(QWEN3_8B_V4, |m| {
            m.remove("hidden_size");
        });
        match TargetConfig::from_json_str(&text).unwrap_err() {
            ConfigError::MissingField { field, .. } => assert_eq!(field, "hidden_size"),
            e => panic!("{e}"),
        }
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("vocab_size".into(), json!(0));
        });
        match TargetConfig::from_json_str(&text).unwrap_err() {
            ConfigError::InvalidField { field, .. } => assert_eq!(field, "vocab_size"),
            e => panic!("{e}"),
        }
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("num_hidden_layers".into(), json!("36"));
        });
        let e = TargetConfig::from_json_str(&text).unwrap_err();
        assert!(e.to_string().contains("num_hidden_layers"), "{e}");
    }

    #[test]
    fn file_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("dflash-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        std::fs::write(
            &path,
            with(QWEN3_8B_V4, |m| {
                m.remove("vocab_size");
            }),
        )
        .unwrap();
        let e = TargetConfig::from_file(&path).unwrap_err();
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        assert!(matches!(TargetConfig::from_file(dir.join("nope.json")), Err(ConfigError::Io { .. })));
        std::fs::write(&path, "{ not json").unwrap();
        assert!(matches!(TargetConfig::from_file(&path), Err(ConfigError::Json { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn heads_must_divide() {
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("num_key_value_heads".into(), json!(5));
        });
        assert!(matches!(
            TargetConfig::from_json_str(&text).unwrap_err(),
            ConfigError::HeadsNotDivisible { heads: 32, kv_heads: 5, .. }
        ));
    }

    #[test]
    fn non_qwen3_models_are_rejected() {
        for model_type in ["qwen3_moe", "llama", "qwen2"] {
            let text = with(QWEN3_8B_V4, |m| {
                m.insert("model_type".into(), json!(model_type));
            });
            let e = TargetConfig::from_json_str(&text).unwrap_err();
            assert!(matches!(e, ConfigError::UnsupportedModel { .. }));
            assert!(e.to_string().contains("only Qwen3 dense"), "{e}");
        }
        let text = with(QWEN3_8B_V4, |m| {
            m.remove("model_type");
        });
        assert!(matches!(
            TargetConfig::from_json_str(&text),
            Err(ConfigError::MissingField { field: "model_type", .. })
        ));
    }

    #[test]
    fn rope_scaling_is_rejected() {
        let yarn = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("rope_scaling".into(), yarn.clone());
        });
        assert!(matches!(
            TargetConfig::from_json_str(&text).unwrap_err(),
            ConfigError::UnsupportedRope { field: "rope_scaling", .. }
        ));
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("rope_parameters".into(), json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}));
        });
        assert!(matches!(
            TargetConfig::from_json_str(&text).unwrap_err(),
            ConfigError::UnsupportedRope { field: "rope_parameters", .. }
        ));
        // A default-typed rope_scaling object is harmless.
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("rope_scaling".into(), json!({"type": "default"}));
        });
        assert!(TargetConfig::from_json_str(&text).is_ok());
        // Disagreeing thetas are ambiguous.
        let text = with(QWEN3_8B_V4, |m| {
            m.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 1e4}));
        });
        assert!(matches!(
            TargetConfig::from_json_str(&text),
            Err(ConfigError::InvalidField { field: "rope_theta", .. })
        ));
    }

    #[test]
    fn unimplemented_features_are_rejected() {
        for (k, v) in
            [("use_sliding_window", json!(true)), ("hidden_act", json!("gelu")), ("attention_bias", json!(true))]
        {
            let text = with(QWEN3_8B_V4, |m| {
                m.insert(k.into(), v.clone());
            });
            assert!(matches!(TargetConfig::from_json_str(&text), Err(ConfigError::InvalidField { .. })), "{k}");
        }
    }

    /// Qwen3.6-27B's text config (QWEN35.md section 1), as the vision-language wrapper nests it.
    const QWEN36_27B_VLM: &str = r#"{
      "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
      "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": false,
      "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152},
      "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": false, "attention_dropout": 0.0,
        "attn_output_gate": true, "eos_token_id": 248044, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
        "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
          "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "vocab_size": 248320
      }
    }"#;

    /// The same text model as a flat text-only config (what `save_pretrained` writes for a text
    /// config), with the older spellings: no layer_types (the every-4th default), top-level RoPE.
    const QWEN36_27B_TEXT_OLD: &str = r#"{
      "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
      "attn_output_gate": true, "eos_token_id": 248044, "head_dim": 256, "hidden_act": "silu",
      "hidden_size": 5120, "intermediate_size": 17408, "full_attention_interval": 4,
      "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
      "linear_num_value_heads": 48, "linear_value_head_dim": 128,
      "max_position_embeddings": 262144, "num_attention_heads": 24, "num_hidden_layers": 64,
      "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
      "partial_rotary_factor": 0.25, "tie_word_embeddings": false, "vocab_size": 248320
    }"#;

    fn text_of(vlm: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> String {
        with(vlm, |m| edit(m.get_mut("text_config").unwrap().as_object_mut().unwrap()))
    }

    #[test]
    fn qwen36_27b_both_layouts_match_the_preset() {
        let vlm = TargetConfig::from_json_str(QWEN36_27B_VLM).unwrap();
        let flat = TargetConfig::from_json_str(QWEN36_27B_TEXT_OLD).unwrap();
        let hy = vlm.hybrid().expect("a hybrid config");
        assert_eq!(vlm.architectures, vec!["Qwen3_5ForConditionalGeneration"]);
        assert_eq!((vlm.hidden_size, vlm.num_hidden_layers, vlm.intermediate_size), (5120, 64, 17408));
        assert_eq!((vlm.num_attention_heads, vlm.num_key_value_heads, vlm.head_dim), (24, 4, 256));
        assert_eq!((hy.linear_num_key_heads, hy.linear_num_value_heads), (16, 48));
        assert_eq!((hy.linear_key_head_dim, hy.linear_value_head_dim, hy.linear_conv_kernel_dim), (128, 128, 4));
        assert_eq!((vlm.rope_theta, hy.partial_rotary_factor, hy.rotary_dim(vlm.head_dim)), (1e7, 0.25, 64));
        assert_eq!((vlm.vocab_size, vlm.tie_word_embeddings, vlm.rms_norm_eps), (248_320, false, 1e-6));
        let full: Vec<usize> = (0..64).filter(|&i| hy.layer_types[i] == LayerType::Full).collect();
        assert_eq!(full, (0..16).map(|k| 4 * k + 3).collect::<Vec<_>>(), "layers 3, 7, ..., 63");
        assert_eq!((hy.key_dim(), hy.value_dim(), hy.conv_dim()), (2048, 6144, 10240));
        assert_eq!(vlm.resolved_mask_token_id().unwrap(), 248_070);
        // The flat layout and the older spellings read to the same model.
        assert_eq!(TargetConfig { architectures: flat.architectures.clone(), ..vlm.clone() }, flat);
        // And both are the preset's shape (the preset names no eos and sets the mask token).
        let preset = TargetConfig::preset("qwen3.6-27b-shape").unwrap();
        let read = TargetConfig {
            architectures: preset.architectures.clone(),
            eos_token_id: Vec::new(),
            mask_token_id: Some(248_070),
            ..flat
        };
        assert_eq!(read, preset);
        // Qwen3.6-27B: about 26.9 B parameters in the text model (untied head).
        assert_eq!(preset.num_params(), 26_895_998_464);
    }

    #[test]
    fn qwen35_defaults_follow_transformers() {
        // No layer_types and no interval: every 4th layer; no partial_rotary_factor: 0.25;
        // no head_dim: 256.
        let text = with(QWEN36_27B_TEXT_OLD, |m| {
            m.remove("full_attention_interval");
            m.remove("partial_rotary_factor");
            m.remove("head_dim");
            m.insert("num_hidden_layers".into(), json!(8));
        });
        let cfg = TargetConfig::from_json_str(&text).unwrap();
        let hy = cfg.hybrid().unwrap();
        use LayerType::{Full as F, Linear as L};
        assert_eq!(hy.layer_types, vec![L, L, L, F, L, L, L, F]);
        assert_eq!((hy.partial_rotary_factor, cfg.head_dim), (0.25, 256));
        let text = with(&text, |m| {
            m.insert("full_attention_interval".into(), json!(2));
        });
        let hy = TargetConfig::from_json_str(&text).unwrap().hybrid().unwrap().clone();
        assert_eq!(hy.layer_types, vec![L, F, L, F, L, F, L, F]);
    }

    #[test]
    fn qwen35_errors_name_the_problem() {
        // MoE, in either layout.
        let moe = with(QWEN36_27B_VLM, |m| {
            m.insert("model_type".into(), json!("qwen3_5_moe"));
        });
        let e = TargetConfig::from_json_str(&moe).unwrap_err();
        assert!(matches!(&e, ConfigError::UnsupportedModel { model_type, .. } if model_type == "qwen3_5_moe"));
        assert!(e.to_string().contains("qwen3_5_moe") && e.to_string().contains("dense"), "{e}");
        let inner_moe = text_of(QWEN36_27B_VLM, |t| {
            t.insert("model_type".into(), json!("qwen3_5_moe_text"));
        });
        assert!(matches!(TargetConfig::from_json_str(&inner_moe), Err(ConfigError::UnsupportedModel { .. })));
        // A wrapper without its text model.
        let no_text = with(QWEN36_27B_VLM, |m| {
            m.remove("text_config");
        });
        assert!(matches!(
            TargetConfig::from_json_str(&no_text),
            Err(ConfigError::MissingField { field: "text_config", .. })
        ));
        // An unknown layer type, named with its index.
        let bad_layer = text_of(QWEN36_27B_VLM, |t| {
            t["layer_types"][5] = json!("sliding_attention");
        });
        let e = TargetConfig::from_json_str(&bad_layer).unwrap_err();
        assert!(matches!(e, ConfigError::InvalidField { field: "layer_types", .. }), "{e}");
        assert!(e.to_string().contains("entry 5") && e.to_string().contains("sliding_attention"), "{e}");
        // layer_types of the wrong length.
        let short = text_of(QWEN36_27B_VLM, |t| {
            t["layer_types"].as_array_mut().unwrap().pop();
        });
        assert!(matches!(
            TargetConfig::from_json_str(&short),
            Err(ConfigError::InvalidField { field: "layer_types", .. })
        ));
        // RoPE scaling.
        let yarn = text_of(QWEN36_27B_VLM, |t| {
            t["rope_parameters"]["rope_type"] = json!("yarn");
        });
        assert!(matches!(
            TargetConfig::from_json_str(&yarn),
            Err(ConfigError::UnsupportedRope { field: "rope_parameters", .. })
        ));
        // An ungated full attention, value heads that key heads do not divide, a rotary width
        // that is not a whole even number of dims, a missing theta.
        for (field, v) in [
            ("attn_output_gate", json!(false)),
            ("linear_num_value_heads", json!(40)),
            ("partial_rotary_factor", json!(0.3)),
        ] {
            let text = with(QWEN36_27B_TEXT_OLD, |m| {
                m.insert(field.into(), v.clone());
            });
            match TargetConfig::from_json_str(&text).unwrap_err() {
                ConfigError::InvalidField { field: f, file, .. } => {
                    assert_eq!((f, file.as_str()), (field, FROM_STRING))
                }
                e => panic!("{field}: {e}"),
            }
        }
        let no_theta = with(QWEN36_27B_TEXT_OLD, |m| {
            m.remove("rope_theta");
        });
        assert!(matches!(TargetConfig::from_json_str(&no_theta), Err(ConfigError::MissingField { .. })));
        // Partial RoPE stays refused for Qwen3 dense.
        let q3 = with(QWEN3_8B_V4, |m| {
            m.insert("partial_rotary_factor".into(), json!(0.5));
        });
        assert!(TargetConfig::from_json_str(&q3).is_err());
    }

    #[test]
    fn qwen35_presets_have_the_promised_shapes() {
        let t = TargetConfig::preset("qwen3.5-tiny").unwrap();
        let hy = t.hybrid().unwrap();
        assert_eq!(t.num_hidden_layers, 8);
        assert_eq!(hy.layer_types.iter().filter(|&&k| k == LayerType::Full).count(), 2);
        assert_eq!((t.hidden_size, t.vocab_size, t.mask_token_id), (64, 256, Some(255)));
        let s = TargetConfig::preset("qwen3.5-small").unwrap();
        assert!(s.num_params() > t.num_params());
        // The file transformers reads back is the same config.
        for name in ["qwen3.5-tiny", "qwen3.5-small", "qwen3.6-27b-shape"] {
            let cfg = TargetConfig::preset(name).unwrap();
            assert_eq!(TargetConfig::from_json_str(&cfg.to_hf_json()).unwrap(), cfg, "{name}");
        }
    }

    /// Written from the rule by hand and checked against Python's `round` (ties-to-even).
    #[test]
    fn default_taps_table() {
        let table: &[(usize, usize, &[usize])] = &[
            (28, 1, &[14]),
            (28, 3, &[1, 13, 25]),
            (28, 5, &[1, 7, 13, 19, 25]),
            (28, 8, &[1, 4, 8, 11, 15, 18, 22, 25]),
            (30, 1, &[15]),
            (30, 3, &[1, 14, 27]),
            // 1 + i*26/4 = 1, 7.5, 14, 20.5, 27: the ties go to the even neighbour (8 and 20).
            (30, 5, &[1, 8, 14, 20, 27]),
            (30, 8, &[1, 5, 8, 12, 16, 20, 23, 27]),
            (36, 1, &[18]),
            (36, 3, &[1, 17, 33]),
            (36, 5, &[1, 9, 17, 25, 33]),
            (36, 8, &[1, 6, 10, 15, 19, 24, 28, 33]),
            (64, 1, &[32]),
            (64, 3, &[1, 31, 61]),
            (64, 5, &[1, 16, 31, 46, 61]),
            (64, 8, &[1, 10, 18, 27, 35, 44, 52, 61]),
        ];
        for &(l, n, want) in table {
            assert_eq!(default_tap_layers(l, n), want, "L={l} n={n}");
        }
    }

    /// Regression guard: `f64::round` (half away from zero) would give 21 for 20.5 at L=30, n=5,
    /// which disagrees with the Python reference and silently taps a different layer.
    #[test]
    fn default_taps_tie_goes_to_even_not_away_from_zero() {
        let x: f64 = 1.0 + (3.0 * 26.0) / 4.0;
        assert_eq!(x, 20.5);
        assert_eq!(x.round(), 21.0);
        assert_eq!(default_tap_layers(30, 5)[3], 20);
        // L=28, n=17: 1 + i*24/16 has ties at every odd i (2.5, 5.5, ...).
        assert_eq!(default_tap_layers(28, 17), [1, 2, 4, 6, 7, 8, 10, 12, 13, 14, 16, 18, 19, 20, 22, 24, 25]);
    }

    #[test]
    fn tap_validation() {
        assert!(matches!(resolve_tap_layers(3, 2, None), Err(ConfigError::TooFewLayersForDefaultTaps { .. })));
        assert_eq!(resolve_tap_layers(3, 2, Some(vec![0, 2])).unwrap(), vec![0, 2]);
        assert_eq!(resolve_tap_layers(3, 1, None).unwrap(), vec![1]);
        assert!(matches!(
            resolve_tap_layers(36, 2, Some(vec![1, 36])),
            Err(ConfigError::TapOutOfRange { id: 36, num_layers: 36 })
        ));
        assert!(matches!(resolve_tap_layers(36, 2, Some(vec![9, 1])), Err(ConfigError::TapsNotSorted { .. })));
        assert_eq!(resolve_tap_layers(4, 2, None).unwrap(), vec![1, 1]);
        assert!(matches!(resolve_tap_layers(36, 2, Some(vec![])), Err(ConfigError::NoTaps)));
        // The default never leaves the target for any L >= 4.
        for l in 4..100 {
            for n in 1..=l.min(12) {
                validate_tap_layers(l, &default_tap_layers(l, n)).unwrap_or_else(|e| panic!("L={l} n={n}: {e}"));
            }
        }
    }

    #[test]
    fn gamma_rule() {
        assert_eq!(default_gamma(16), 7.0);
        assert_eq!(default_gamma(8), 4.0);
        assert_eq!(default_gamma(4), 2.5);
        assert_eq!(default_gamma(32), 13.0);
    }

    #[test]
    fn drafter_for_target_and_round_trip() {
        let target = TargetConfig::preset("qwen3-8b-shape").unwrap();
        let d = DrafterConfig::for_target(&target, 5, 16, None).unwrap();
        assert_eq!(d.target_layer_ids, vec![1, 9, 17, 25, 33]);
        assert_eq!((d.mask_token_id, d.gamma, d.num_target_layers), (151_669, 7.0, 36));
        assert_eq!(d.hidden_size, 4096);
        let v = d.to_json_value();
        assert_eq!(v["architectures"], json!(["DFlashDraftModel"]));
        assert_eq!(v["model_type"], "qwen3");
        assert_eq!(v["num_hidden_layers"], 5);
        assert_eq!(v["num_target_layers"], 36);
        assert_eq!(v["block_size"], 16);
        assert_eq!(v["dflash_config"]["mask_token_id"], 151_669);
        assert_eq!(v["dflash_config"]["target_layer_ids"], json!([1, 9, 17, 25, 33]));
        assert_eq!(DrafterConfig::from_json_str(&d.to_json()).unwrap(), d);
        d.check_against_target(&target).unwrap();

        let tiny = TargetConfig::preset("tiny").unwrap();
        let d = DrafterConfig::for_target(&tiny, 2, 8, Some(vec![1, 3, 5])).unwrap();
        assert_eq!((d.num_taps(), d.gamma, d.mask_token_id), (3, 4.0, 255));
        assert_eq!(DrafterConfig::from_json_str(&d.to_json()).unwrap(), d);
        assert!(matches!(d.check_against_target(&target), Err(ConfigError::TargetMismatch { .. })));
    }

    /// The layout of a public DFlash drafter config (written from its documented fields): read
    /// it, including the fallback to default taps when `target_layer_ids` is absent.
    #[test]
    fn reads_public_style_drafter_config() {
        let text = r#"{
          "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
          "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
          "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
          "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
          "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
          "vocab_size": 151936, "tie_word_embeddings": false
        }"#;
        let d = DrafterConfig::from_json_str(text).unwrap();
        assert_eq!(d.target_layer_ids, vec![1, 9, 17, 25, 33]);
        assert_eq!(d.gamma, 7.0);
        let no_taps = with(text, |m| {
            m["dflash_config"].as_object_mut().unwrap().remove("target_layer_ids");
        });
        assert_eq!(DrafterConfig::from_json_str(&no_taps).unwrap().target_layer_ids, vec![1, 9, 17, 25, 33]);
        let bad = with(text, |m| {
            m["dflash_config"]["target_layer_ids"] = json!([1, 36]);
        });
        assert!(matches!(DrafterConfig::from_json_str(&bad), Err(ConfigError::TapOutOfRange { .. })));
        // A target config is not a drafter config, and vice versa.
        assert!(DrafterConfig::from_json_str(QWEN3_8B_V4).is_err());
        assert!(TargetConfig::from_json_str(text).is_err());
    }

    #[test]
    fn drafter_validation() {
        let tiny = TargetConfig::preset("tiny").unwrap();
        assert!(matches!(DrafterConfig::for_target(&tiny, 0, 16, None), Err(ConfigError::InvalidDrafter { .. })));
        assert!(matches!(DrafterConfig::for_target(&tiny, 2, 1, None), Err(ConfigError::InvalidDrafter { .. })));
        let mut no_mask = tiny.clone();
        no_mask.mask_token_id = None;
        assert!(matches!(DrafterConfig::for_target(&no_mask, 2, 16, None), Err(ConfigError::NoMaskToken { .. })));
    }
}
