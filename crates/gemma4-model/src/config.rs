//! `config.json` parsing, resolved into one plain description per layer.
//!
//! Hugging Face stores Gemma 4 text settings in several layouts
//! (`Gemma4ForConditionalGeneration` with `text_config`, a flat `gemma4_text`
//! config, `gemma4_unified`), and derives per-layer shapes from a handful of
//! global fields. [`TextConfig::from_hf_json`] does that derivation once, so the
//! forward pass only ever reads [`LayerSpec`]s.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::ConfigError;

/// Which attention mask a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Causal and limited to the last `sliding_window` positions (itself included).
    Sliding,
    /// Causal over the whole sequence.
    Full,
}

/// Rotary embedding of one layer: `inv_freq[i] = theta^(-2i / head_dim)` for
/// `i < rotated_pairs`, and 0 (identity) for the remaining `head_dim/2 - rotated_pairs`
/// pairs. Rotation pairs dimension `j` with `j + head_dim/2` (rotate-half layout).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub head_dim: usize,
    pub rotated_pairs: usize,
    /// Positions are divided by this before rotation (linear RoPE scaling; 1.0 = none).
    pub position_scale: f64,
}

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSource {
    /// The layer projects its own K/V and owns cache memory.
    Own,
    /// The layer reads the cache of an earlier layer of the same attention kind.
    SharedFrom(usize),
}

/// Everything the forward pass needs to know about one decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    pub kind: AttentionKind,
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// `attention_k_eq_v` on a full layer: V is the raw K projection (no `v_proj`).
    pub v_is_k: bool,
    pub kv: KvSource,
    pub intermediate_size: usize,
    pub rope: RopeSpec,
}

/// Mixture-of-experts block settings (26B-A4B style).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
}

/// Numerical conventions that differ between Gemma generations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Conventions {
    /// Multiplier applied to `q·kᵀ` (1.0 for Gemma 4, `query_pre_attn_scalar^-1/2` for Gemma 3).
    pub attention_scale: f64,
    /// Gemma 4 normalises V with a weight-less RMSNorm; Gemma 3 does not.
    pub v_norm: bool,
    /// Gemma 4 scales each layer's output by a stored `layer_scalar`.
    pub layer_scalar: bool,
}

/// The resolved text-model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub rms_norm_eps: f64,
    pub sliding_window: usize,
    pub max_position_embeddings: usize,
    pub final_logit_softcapping: Option<f64>,
    /// Per-layer-embedding width (E2B/E4B); 0 when the model has none.
    pub ple_dim: usize,
    pub moe: Option<MoeSpec>,
    pub layers: Vec<LayerSpec>,
    pub conventions: Conventions,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// How the soft tokens of one image see each other.
    pub image_attention: ImageAttention,
    /// Keys of the text config this loader does not know and ignored (named
    /// with their `text_config.` prefix), for warnings and `gemma4 doctor`.
    pub unknown_keys: Vec<String>,
}

/// `use_bidirectional_attention: "vision"`: how one image's soft tokens see
/// each other (a query sees every key of its own image, later ones too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageAttention {
    /// Strictly causal (E2B/E4B).
    Causal,
    /// On sliding layers only, and only within the window (31B, 26B-A4B:
    /// `AND(window, OR(causal, same image))`).
    SlidingWindows,
    /// On every layer, past the window too (the 12B, `gemma4_unified`:
    /// `OR(causal ∧ window, same image)`).
    EveryLayer,
}

impl ImageAttention {
    /// Whether an image's soft tokens must be computed in one step.
    pub fn is_bidirectional(self) -> bool {
        self != Self::Causal
    }
}

/// `text_config` exactly as stored, without the keys this loader does not know.
#[derive(Debug, Deserialize)]
struct RawTextConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    global_head_dim: Option<usize>,
    num_global_key_value_heads: Option<usize>,
    #[serde(default)]
    attention_k_eq_v: bool,
    #[serde(default)]
    num_kv_shared_layers: usize,
    #[serde(default)]
    use_double_wide_mlp: bool,
    #[serde(default)]
    hidden_size_per_layer_input: Option<usize>,
    vocab_size_per_layer_input: Option<usize>,
    #[serde(default)]
    enable_moe_block: bool,
    num_experts: Option<usize>,
    top_k_experts: Option<usize>,
    moe_intermediate_size: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window: usize,
    rms_norm_eps: f64,
    final_logit_softcapping: Option<f64>,
    hidden_activation: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    max_position_embeddings: Option<usize>,
    rope_parameters: Option<BTreeMap<String, RawRope>>,
    per_layer_config: Option<BTreeMap<String, RawLayerOverride>>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<Value>,
    pad_token_id: Option<u32>,
    use_bidirectional_attention: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRope {
    rope_type: Option<String>,
    rope_theta: f64,
    partial_rotary_factor: Option<f64>,
    factor: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLayerOverride {
    head_dim: Option<usize>,
    num_key_value_heads: Option<usize>,
}

/// Keys of a Gemma text config that this loader understands (the fields above)
/// plus generic bookkeeping keys that carry no architecture.
const KNOWN_TEXT_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "use_double_wide_mlp",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "layer_types",
    "sliding_window",
    "rms_norm_eps",
    "final_logit_softcapping",
    "hidden_activation",
    "attention_bias",
    "max_position_embeddings",
    "rope_parameters",
    "per_layer_config",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    // Bookkeeping and training-only keys: no effect on inference.
    "attention_dropout",
    "initializer_range",
    "use_cache",
    "tie_word_embeddings",
    "use_bidirectional_attention",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "architectures",
    "_name_or_path",
    "_sliding_window_pattern",
    "sliding_window_pattern",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "unk_token_id",
];

/// Keys a loader could meet that change the computation in ways this one
/// cannot honour: present with any value but `null`, they are errors.
const UNSUPPORTED_TEXT_KEYS: &[(&str, &str)] = &[(
    "rope_scaling",
    "RoPE scaling is read from `rope_parameters`; a separate `rope_scaling` cannot be applied",
)];

/// A checkpoint's declared weight quantization: only compressed-tensors'
/// packed symmetric int4 (Google's `-qat-w4a16-ct` exports) loads, as
/// stored; anything else would be read as if it were plain weights.
fn check_quantization(q: &Value, field: &str) -> Result<(), ConfigError> {
    if q.is_null() {
        return Ok(());
    }
    let refuse = |what: String| {
        ConfigError::invalid(
            field,
            format!("{what}; only compressed-tensors `pack-quantized` symmetric int4 weights load (else use a GGUF file or unquantized weights)"),
        )
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("(none)");
    if method != "compressed-tensors" {
        return Err(refuse(format!("quant_method `{method}`")));
    }
    let default_format = q.get("format").and_then(Value::as_str);
    let groups = q.get("config_groups").and_then(Value::as_object);
    for (name, group) in groups.into_iter().flatten() {
        let format = group
            .get("format")
            .and_then(Value::as_str)
            .or(default_format)
            .unwrap_or("(none)");
        if format != "pack-quantized" {
            return Err(refuse(format!("group `{name}` has format `{format}`")));
        }
        let w = &group["weights"];
        let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
        let kind = w.get("type").and_then(Value::as_str).unwrap_or("(none)");
        let symmetric = w.get("symmetric").and_then(Value::as_bool).unwrap_or(true);
        if bits != 4 || kind != "int" || !symmetric {
            let shape = if symmetric { "symmetric" } else { "asymmetric" };
            return Err(refuse(format!(
                "group `{name}` stores weights as {shape} {bits}-bit {kind}"
            )));
        }
        if group.get("input_activations").is_some_and(|a| !a.is_null()) {
            return Err(refuse(format!("group `{name}` also quantizes activations")));
        }
    }
    Ok(())
}

const TEXT_MODEL_TYPES: &[&str] = &[
    "gemma4_text",
    "gemma4_unified_text",
    "gemma3_text",
    "gemma3",
];

impl TextConfig {
    /// Reads and resolves `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_hf_json(&json)
    }

    /// Resolves a parsed `config.json` (composite or text-only layout).
    pub fn from_hf_json(json: &Value) -> Result<Self, ConfigError> {
        let top = json.as_object().ok_or_else(|| {
            ConfigError::invalid("config.json", "the file must hold a JSON object")
        })?;
        let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
        let (text, field_prefix) = match model_type {
            "gemma4" | "gemma4_unified" | "gemma3" if top.contains_key("text_config") => {
                let text = top.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                    ConfigError::invalid("text_config", "must be an object with the text model's settings")
                })?;
                (text, "text_config.")
            }
            t if TEXT_MODEL_TYPES.contains(&t) => (top, ""),
            "" => return Err(ConfigError::missing("model_type")),
            other => {
                return Err(ConfigError::invalid(
                    "model_type",
                    format!("`{other}` is not a Gemma 4 (or Gemma 3) text model; expected gemma4, gemma4_unified, gemma4_text or gemma4_unified_text"),
                ))
            }
        };
        for (key, why) in UNSUPPORTED_TEXT_KEYS {
            if text.get(*key).is_some_and(|v| !v.is_null()) {
                return Err(ConfigError::invalid(format!("{field_prefix}{key}"), *why));
            }
        }
        if let Some(q) = top.get("quantization_config") {
            check_quantization(q, "quantization_config")?;
        }
        if let Some(q) = text
            .get("quantization_config")
            .filter(|_| !field_prefix.is_empty())
        {
            check_quantization(q, &format!("{field_prefix}quantization_config"))?;
        }
        // Keys from newer releases are ignored (with a warning): a key that
        // changed the computation would have to be listed above to be refused.
        let mut known = text.clone();
        let mut unknown_keys = Vec::new();
        known.retain(|key, _| {
            if key == "quantization_config" {
                return false;
            }
            let keep = KNOWN_TEXT_KEYS.contains(&key.as_str())
                || UNSUPPORTED_TEXT_KEYS.iter().any(|(k, _)| k == key);
            if !keep {
                unknown_keys.push(format!("{field_prefix}{key}"));
            }
            keep
        });
        if !unknown_keys.is_empty() {
            tracing::warn!(
                keys = %unknown_keys.join(", "),
                "config.json has keys this version does not know; ignoring them"
            );
        }
        let raw: RawTextConfig = serde_json::from_value(Value::Object(known)).map_err(|e| {
            ConfigError::invalid(
                field_prefix.trim_end_matches('.').to_string(),
                e.to_string(),
            )
        })?;
        // The top-level eos list (e.g. [1, 106]) is the generation contract; prefer it.
        let eos = top
            .get("eos_token_id")
            .or(raw.eos_token_id.as_ref())
            .cloned();
        let mut config = resolve(raw, eos.as_ref(), field_prefix)?;
        config.unknown_keys = unknown_keys;
        Ok(config)
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether this is a Gemma 3 model (different norm and attention conventions).
    pub fn is_gemma3(&self) -> bool {
        self.model_type.starts_with("gemma3")
    }
}

fn resolve(raw: RawTextConfig, eos: Option<&Value>, p: &str) -> Result<TextConfig, ConfigError> {
    let f = |name: &str| format!("{p}{name}");
    let model_type = raw
        .model_type
        .clone()
        .unwrap_or_else(|| "gemma4_text".into());
    let gemma3 = model_type.starts_with("gemma3");
    let image_attention = match raw.use_bidirectional_attention.as_deref() {
        None => ImageAttention::Causal,
        // The 12B's own masks (`gemma4_unified`) lay the image block over
        // every layer's mask; Gemma 4's only inside sliding windows.
        Some("vision") if model_type.starts_with("gemma4_unified") => ImageAttention::EveryLayer,
        Some("vision") => ImageAttention::SlidingWindows,
        Some(other) => {
            return Err(ConfigError::invalid(
                f("use_bidirectional_attention"),
                format!("`{other}` is not supported (only \"vision\" or null)"),
            ))
        }
    };
    let n = raw.num_hidden_layers;
    if n == 0 {
        return Err(ConfigError::invalid(
            f("num_hidden_layers"),
            "must be at least 1",
        ));
    }
    for (name, v) in [
        ("vocab_size", raw.vocab_size),
        ("hidden_size", raw.hidden_size),
        ("intermediate_size", raw.intermediate_size),
        ("num_attention_heads", raw.num_attention_heads),
        ("num_key_value_heads", raw.num_key_value_heads),
        ("head_dim", raw.head_dim),
        ("sliding_window", raw.sliding_window),
    ] {
        if v == 0 {
            return Err(ConfigError::invalid(f(name), "must be positive"));
        }
    }
    if let Some(act) = &raw.hidden_activation {
        if act != "gelu_pytorch_tanh" {
            return Err(ConfigError::invalid(
                f("hidden_activation"),
                format!("`{act}` is not supported; Gemma uses gelu_pytorch_tanh"),
            ));
        }
    }
    if raw.attention_bias {
        return Err(ConfigError::invalid(
            f("attention_bias"),
            "Gemma has no attention bias; `true` is not supported",
        ));
    }
    if raw.attn_logit_softcapping.is_some_and(|c| c > 0.0) {
        return Err(ConfigError::invalid(
            f("attn_logit_softcapping"),
            "attention-logit soft-capping (Gemma 2) is not supported",
        ));
    }
    let kinds = layer_kinds(&raw, gemma3, p)?;
    let ple_dim = raw.hidden_size_per_layer_input.unwrap_or(0);
    if ple_dim > 0 {
        if let Some(v) = raw.vocab_size_per_layer_input {
            if v != raw.vocab_size {
                return Err(ConfigError::invalid(
                    f("vocab_size_per_layer_input"),
                    format!(
                        "{v} differs from vocab_size {}; not supported",
                        raw.vocab_size
                    ),
                ));
            }
        }
    }
    let moe = if raw.enable_moe_block {
        let need = |v: Option<usize>, name: &str| {
            v.filter(|x| *x > 0).ok_or_else(|| {
                ConfigError::invalid(
                    f(name),
                    "must be a positive number when enable_moe_block is true",
                )
            })
        };
        let spec = MoeSpec {
            num_experts: need(raw.num_experts, "num_experts")?,
            top_k: need(raw.top_k_experts, "top_k_experts")?,
            intermediate_size: need(raw.moe_intermediate_size, "moe_intermediate_size")?,
        };
        if spec.top_k > spec.num_experts {
            return Err(ConfigError::invalid(
                f("top_k_experts"),
                "exceeds num_experts",
            ));
        }
        Some(spec)
    } else {
        None
    };
    if raw.num_kv_shared_layers >= n {
        return Err(ConfigError::invalid(
            f("num_kv_shared_layers"),
            format!(
                "{} leaves no layer to produce K/V ({} layers)",
                raw.num_kv_shared_layers, n
            ),
        ));
    }
    let first_shared = n - raw.num_kv_shared_layers;
    let ropes = rope_specs(&raw, gemma3, p)?;
    let mut layers = Vec::with_capacity(n);
    for (i, &kind) in kinds.iter().enumerate() {
        let mut head_dim = raw.head_dim;
        let mut kv_heads = raw.num_key_value_heads;
        let v_is_k = kind == AttentionKind::Full && raw.attention_k_eq_v;
        if kind == AttentionKind::Full {
            if let Some(g) = raw.global_head_dim {
                head_dim = g;
            }
            if raw.attention_k_eq_v {
                if let Some(g) = raw.num_global_key_value_heads {
                    kv_heads = g;
                }
            }
        }
        if let Some(over) = raw
            .per_layer_config
            .as_ref()
            .and_then(|m| layer_override(m, i))
        {
            if let Some(h) = over.head_dim {
                head_dim = h;
            }
            if let Some(k) = over.num_key_value_heads {
                kv_heads = k;
            }
        }
        if head_dim == 0 || kv_heads == 0 {
            return Err(ConfigError::invalid(
                f("per_layer_config"),
                format!("layer {i} has a zero head_dim or KV-head count"),
            ));
        }
        if !raw.num_attention_heads.is_multiple_of(kv_heads) {
            return Err(ConfigError::invalid(
                f("num_key_value_heads"),
                format!(
                    "layer {i}: {} attention heads are not a multiple of {kv_heads} KV heads",
                    raw.num_attention_heads
                ),
            ));
        }
        let kv = if i >= first_shared {
            let producer = (0..first_shared).rev().find(|&j| kinds[j] == kind).ok_or_else(|| {
                ConfigError::invalid(
                    f("num_kv_shared_layers"),
                    format!("layer {i} shares K/V but no earlier non-shared layer has its attention type"),
                )
            })?;
            KvSource::SharedFrom(producer)
        } else {
            KvSource::Own
        };
        let wide = raw.use_double_wide_mlp && i >= first_shared;
        // Frequencies follow the layer's own head_dim.
        let rope = match kind {
            AttentionKind::Sliding => ropes.0,
            AttentionKind::Full => ropes.1,
        }
        .for_head_dim(head_dim);
        layers.push(LayerSpec {
            kind,
            head_dim,
            num_kv_heads: kv_heads,
            v_is_k,
            kv,
            intermediate_size: if wide {
                raw.intermediate_size * 2
            } else {
                raw.intermediate_size
            },
            rope,
        });
    }
    // A producer must agree with its consumers on shape.
    for (i, l) in layers.iter().enumerate() {
        if let KvSource::SharedFrom(j) = l.kv {
            let pl = &layers[j];
            if pl.head_dim != l.head_dim || pl.num_kv_heads != l.num_kv_heads {
                return Err(ConfigError::invalid(
                    f("num_kv_shared_layers"),
                    format!("layer {i} reads layer {j}'s K/V but their head shapes differ"),
                ));
            }
        }
    }
    let conventions = if gemma3 {
        let s = raw.query_pre_attn_scalar.unwrap_or(raw.head_dim as f64);
        Conventions {
            attention_scale: s.powf(-0.5),
            v_norm: false,
            layer_scalar: false,
        }
    } else {
        Conventions {
            attention_scale: 1.0,
            v_norm: true,
            layer_scalar: true,
        }
    };
    Ok(TextConfig {
        model_type,
        vocab_size: raw.vocab_size,
        hidden_size: raw.hidden_size,
        num_attention_heads: raw.num_attention_heads,
        rms_norm_eps: raw.rms_norm_eps,
        sliding_window: raw.sliding_window,
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(8192),
        final_logit_softcapping: raw.final_logit_softcapping.filter(|c| *c > 0.0),
        ple_dim,
        moe,
        layers,
        conventions,
        bos_token_id: raw.bos_token_id,
        eos_token_ids: eos_list(eos, &f("eos_token_id"))?,
        pad_token_id: raw.pad_token_id,
        image_attention,
        unknown_keys: Vec::new(),
    })
}

fn layer_override(map: &BTreeMap<String, RawLayerOverride>, i: usize) -> Option<&RawLayerOverride> {
    map.iter()
        .find(|(k, _)| {
            k.trim_start_matches('0').parse::<usize>().unwrap_or(0) == i
                && k.parse::<usize>().is_ok()
        })
        .map(|(_, v)| v)
}

fn eos_list(v: Option<&Value>, field: &str) -> Result<Vec<u32>, ConfigError> {
    let as_id = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ConfigError::invalid(field, "must be a token id or a list of token ids"))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(as_id).collect(),
        Some(x) => Ok(vec![as_id(x)?]),
    }
}

fn layer_kinds(
    raw: &RawTextConfig,
    gemma3: bool,
    p: &str,
) -> Result<Vec<AttentionKind>, ConfigError> {
    let field = format!("{p}layer_types");
    match &raw.layer_types {
        Some(types) => {
            if types.len() != raw.num_hidden_layers {
                return Err(ConfigError::invalid(
                    field,
                    format!(
                        "has {} entries but num_hidden_layers is {}",
                        types.len(),
                        raw.num_hidden_layers
                    ),
                ));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "sliding_attention" => Ok(AttentionKind::Sliding),
                    "full_attention" => Ok(AttentionKind::Full),
                    other => Err(ConfigError::invalid(
                        field.clone(),
                        format!(
                            "entry {i} is `{other}`; expected sliding_attention or full_attention"
                        ),
                    )),
                })
                .collect()
        }
        // Gemma 3 configs written before `layer_types` existed use a fixed 5:1 pattern.
        None if gemma3 => Ok((0..raw.num_hidden_layers)
            .map(|i| {
                if (i + 1) % 6 == 0 {
                    AttentionKind::Full
                } else {
                    AttentionKind::Sliding
                }
            })
            .collect()),
        None => Err(ConfigError::missing(field)),
    }
}

/// RoPE settings of one attention kind, before the layer's head_dim is known.
#[derive(Debug, Clone, Copy)]
struct RopeParams {
    theta: f64,
    rotated_fraction: f64,
    position_scale: f64,
}

impl RopeParams {
    fn for_head_dim(self, head_dim: usize) -> RopeSpec {
        // Python: int(partial_rotary_factor * head_dim // 2).
        let rotated_pairs = ((self.rotated_fraction * head_dim as f64) / 2.0).floor() as usize;
        RopeSpec {
            theta: self.theta,
            head_dim,
            rotated_pairs,
            position_scale: self.position_scale,
        }
    }
}

/// RoPE parameters for (sliding, full) layers.
fn rope_specs(
    raw: &RawTextConfig,
    gemma3: bool,
    p: &str,
) -> Result<(RopeParams, RopeParams), ConfigError> {
    let field = format!("{p}rope_parameters");
    let params = match &raw.rope_parameters {
        Some(m) => m,
        None if gemma3 => {
            let local = RopeParams {
                theta: 10_000.0,
                rotated_fraction: 1.0,
                position_scale: 1.0,
            };
            let global = RopeParams {
                theta: 1_000_000.0,
                ..local
            };
            return Ok((local, global));
        }
        None => return Err(ConfigError::missing(field)),
    };
    for key in params.keys() {
        if key != "sliding_attention" && key != "full_attention" {
            return Err(ConfigError::UnknownField(format!("{field}.{key}")));
        }
    }
    let one = |key: &str| -> Result<RopeParams, ConfigError> {
        let field = format!("{field}.{key}");
        let r = params
            .get(key)
            .ok_or_else(|| ConfigError::missing(field.clone()))?;
        let factor = r.partial_rotary_factor.unwrap_or(1.0);
        if !(factor > 0.0 && factor <= 1.0) {
            return Err(ConfigError::invalid(
                format!("{field}.partial_rotary_factor"),
                "must be in (0, 1]",
            ));
        }
        let kind = r.rope_type.as_deref().unwrap_or("default");
        let (rotated_fraction, position_scale) = match kind {
            "default" => {
                if factor != 1.0 {
                    return Err(ConfigError::invalid(
                        format!("{field}.partial_rotary_factor"),
                        "partial rotation is only supported with rope_type `proportional`",
                    ));
                }
                (1.0, 1.0)
            }
            "proportional" => (factor, 1.0),
            "linear" => {
                let s = r
                    .factor
                    .ok_or_else(|| ConfigError::missing(format!("{field}.factor")))?;
                (1.0, s)
            }
            other => {
                return Err(ConfigError::invalid(
                    format!("{field}.rope_type"),
                    format!("`{other}` is not supported (default, proportional, linear)"),
                ))
            }
        };
        Ok(RopeParams {
            theta: r.rope_theta,
            rotated_fraction,
            position_scale,
        })
    };
    Ok((one("sliding_attention")?, one("full_attention")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Value {
        let path = format!(
            "{}/../../tests/fixtures/oracle/{name}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json")
    }

    #[test]
    fn e_style_sharing_and_widths() {
        let c = TextConfig::from_hf_json(&fixture("e-style")).expect("config");
        assert_eq!(c.layers[5].kv, KvSource::SharedFrom(3));
        assert_eq!(c.layers[6].kv, KvSource::SharedFrom(3));
        assert_eq!(c.layers[7].kv, KvSource::SharedFrom(4));
        assert_eq!(c.layers[4].head_dim, 32);
        assert_eq!(c.layers[4].num_kv_heads, 1);
        assert_eq!(c.layers[4].rope.rotated_pairs, 4);
        assert_eq!(c.layers[0].rope.rotated_pairs, 8);
        assert_eq!(c.layers[4].intermediate_size, 128);
        assert_eq!(c.layers[5].intermediate_size, 256);
        assert!(!c.layers[4].v_is_k);
        assert_eq!(c.ple_dim, 16);
        assert_eq!(c.eos_token_ids, vec![1, 106]);
    }

    #[test]
    fn k_eq_v_uses_global_kv_heads() {
        let c = TextConfig::from_hf_json(&fixture("dense-k-eq-v")).expect("config");
        assert_eq!(c.layers[5].num_kv_heads, 1);
        assert!(c.layers[5].v_is_k);
        assert_eq!(c.layers[0].num_kv_heads, 2);
        assert!(!c.layers[0].v_is_k);
    }

    #[test]
    fn save_pretrained_layout_resolves_identically() {
        for v in ["e-style", "dense-k-eq-v", "moe", "unified"] {
            let path = format!(
                "{}/../../tests/fixtures/oracle/{v}/config.save_pretrained.json",
                env!("CARGO_MANIFEST_DIR")
            );
            let json: Value =
                serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
            let a = TextConfig::from_hf_json(&json).expect("save_pretrained form");
            let b = TextConfig::from_hf_json(&fixture(v)).expect("published form");
            assert_eq!(a.layers, b.layers, "{v}");
        }
    }

    #[test]
    fn unknown_keys_are_ignored_and_named() {
        let plain = TextConfig::from_hf_json(&fixture("e-style")).expect("fixture");
        assert!(plain.unknown_keys.is_empty());
        let mut j = fixture("e-style");
        j["text_config"]["frobnicate"] = Value::from(1);
        j["text_config"]["some_future_flag"] = Value::from(true);
        let c = TextConfig::from_hf_json(&j).expect("unknown keys are not fatal");
        assert_eq!(
            c.unknown_keys,
            ["text_config.frobnicate", "text_config.some_future_flag"]
        );
        assert_eq!(c.layers, plain.layers);
        assert_eq!(c.vocab_size, plain.vocab_size);
    }

    #[test]
    fn keys_that_cannot_be_honoured_are_errors() {
        let mut j = fixture("e-style");
        j["text_config"]["rope_scaling"] =
            serde_json::json!({"rope_type": "linear", "factor": 8.0});
        let e = TextConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(e.contains("text_config.rope_scaling"), "{e}");
        j["text_config"]["rope_scaling"] = Value::Null;
        assert!(TextConfig::from_hf_json(&j).is_ok());
        let mut j = fixture("e-style");
        j["text_config"]["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
        let e = TextConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(
            e.contains("text_config.quantization_config") && e.contains("`fp8`"),
            "{e}"
        );
        // Where Hugging Face writes it: only packed symmetric int4 passes.
        let mut j = fixture("e-style");
        let int4 = serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                            "strategy": "group", "group_size": 32}}}
        });
        j["quantization_config"] = int4.clone();
        assert!(TextConfig::from_hf_json(&j).is_ok());
        for (path, value, want) in [
            ("quant_method", serde_json::json!("awq"), "`awq`"),
            (
                "format",
                serde_json::json!("float-quantized"),
                "`float-quantized`",
            ),
            (
                "config_groups/group_0/weights/num_bits",
                serde_json::json!(8),
                "8-bit",
            ),
            (
                "config_groups/group_0/weights/symmetric",
                serde_json::json!(false),
                "asymmetric",
            ),
        ] {
            let mut q = int4.clone();
            *q.pointer_mut(&format!("/{path}")).expect("path") = value;
            j["quantization_config"] = q;
            let e = TextConfig::from_hf_json(&j).unwrap_err().to_string();
            assert!(
                e.contains("quantization_config") && e.contains(want),
                "{path}: {e}"
            );
        }
    }

    #[test]
    fn inconsistent_fields_are_named() {
        let mut j = fixture("e-style");
        j["text_config"]["num_hidden_layers"] = Value::from(9);
        let e = TextConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(e.contains("text_config.layer_types"), "{e}");

        let mut j = fixture("moe");
        j["text_config"]["top_k_experts"] = Value::Null;
        let e = TextConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(e.contains("text_config.top_k_experts"), "{e}");
    }
}
