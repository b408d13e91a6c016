//! llama.cpp GGUF checkpoints of the `gemma3` and `gemma4` architectures.
//!
//! The hyper-parameters come from `gemma3.*` / `gemma4.*` metadata and are turned into
//! the same [`TextConfig`] a Hugging Face `config.json` gives; tensors are
//! found under their GGUF names (`blk.N.attn_q.weight`, …) and handed out
//! as stored: views of the memory-mapped file in their ggml block type.
//! What runs them is the loader's choice ([`crate::loader`]).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::{json, Value as Json};

use crate::config::TextConfig;
use crate::error::{tensor_message, ModelError, Result, WeightError};
use crate::mapped::MappedFile;
use crate::source::WeightSource;
use crate::storage::{StoredDtype, StoredTensor};

/// An open GGUF file.
pub struct GgufSource {
    path: PathBuf,
    content: Content,
    file: Arc<MappedFile>,
    used: Mutex<BTreeSet<String>>,
}

impl GgufSource {
    pub fn open(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let file = MappedFile::open(path)?;
        let mut reader = std::io::Cursor::new((*file).as_ref());
        let content = Content::read(&mut reader).map_err(|e| WeightError::Format {
            path: shown.clone(),
            message: format!("not a readable GGUF file: {}", tensor_message(&e)),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            file,
            used: Mutex::new(BTreeSet::new()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Drops the tokenizer's arrays (vocabulary, scores, merges) from the
    /// metadata: tens of MB of small allocations that a weight load never
    /// reads once the config is resolved (the tokenizer has its own copy).
    pub fn forget_vocabulary(&mut self) {
        self.content
            .metadata
            .retain(|k, v| !(k.starts_with("tokenizer.") && matches!(v, Value::Array(_))));
        self.content.metadata.shrink_to_fit();
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Every tensor's GGUF name, in no particular order.
    pub(crate) fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.content.tensor_infos.keys().map(String::as_str)
    }

    /// A tensor's row-major shape, if the file has it.
    pub(crate) fn dims(&self, gguf_name: &str) -> Option<Vec<usize>> {
        self.content
            .tensor_infos
            .get(gguf_name)
            .map(|i| i.shape.dims().to_vec())
    }

    /// The text configuration described by the metadata.
    pub fn config(&self) -> Result<TextConfig> {
        let json = match self.architecture().unwrap_or("") {
            "gemma3" => self.gemma3_config_json()?,
            "gemma4" => self.gemma4_config_json()?,
            other => {
                return Err(ModelError::Input(format!(
                    "{}: GGUF architecture `{other}` is not supported (supported: gemma3, gemma4)",
                    self.path.display()
                )))
            }
        };
        Ok(TextConfig::from_hf_json(&json)?)
    }

    pub(crate) fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A non-negative integer, stored as any of GGUF's integer types.
    pub(crate) fn meta_usize(&self, key: &str) -> Option<usize> {
        let v = self.meta(key)?;
        v.to_u32()
            .map(|x| x as usize)
            .or_else(|_| v.to_u64().map(|x| x as usize))
            .or_else(|_| v.to_i32().map(|x| x.max(0) as usize))
            .ok()
    }

    fn require(&self, key: &str) -> Result<usize> {
        self.meta_usize(key).ok_or_else(|| self.meta_error(key))
    }

    pub(crate) fn meta_f32(&self, key: &str) -> Option<f32> {
        self.meta(key).and_then(|v| v.to_f32().ok())
    }

    /// An integer that is either one value or one value per layer.
    fn per_layer(&self, key: &str, layers: usize) -> Result<Vec<usize>> {
        match self.meta(key) {
            Some(Value::Array(items)) => {
                let v: Vec<usize> = items
                    .iter()
                    .filter_map(|x| {
                        x.to_u32()
                            .map(|n| n as usize)
                            .or_else(|_| x.to_i32().map(|n| n.max(0) as usize))
                            .ok()
                    })
                    .collect();
                if v.len() != layers {
                    return Err(self.meta_error(key));
                }
                Ok(v)
            }
            Some(_) => Ok(vec![self.require(key)?; layers]),
            None => Err(self.meta_error(key)),
        }
    }

    fn vocab_size(&self) -> Result<usize> {
        if let Some(t) = self.content.tensor_infos.get("token_embd.weight") {
            return Ok(t.shape.dims()[0]);
        }
        match self.meta("tokenizer.ggml.tokens") {
            Some(Value::Array(tokens)) => Ok(tokens.len()),
            _ => Err(WeightError::Missing {
                name: "token_embd.weight".into(),
            }
            .into()),
        }
    }

    fn token_ids(&self) -> (Option<usize>, Option<usize>, Option<usize>) {
        let t = |k: &str| self.meta_usize(&format!("tokenizer.ggml.{k}"));
        (t("bos_token_id"), t("eos_token_id"), t("padding_token_id"))
    }

    /// `gemma3` metadata as an equivalent Hugging Face `gemma3_text` config.
    fn gemma3_config_json(&self) -> Result<Json> {
        let u = |key: &str| self.require(&format!("gemma3.{key}"));
        let f = |key: &str| self.meta_f32(&format!("gemma3.{key}"));
        let layers = u("block_count")?;
        let head_dim = u("attention.key_length")?;
        // llama.cpp hard-codes the 5:1 pattern for gemma3: layer i is global iff i % 6 == 5.
        let layer_types: Vec<&str> = (0..layers)
            .map(|i| {
                if i % 6 == 5 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        let theta = f("rope.freq_base").unwrap_or(1_000_000.0);
        let mut full = json!({"rope_type": "default", "rope_theta": theta});
        let scaling = self
            .meta("gemma3.rope.scaling.type")
            .and_then(|v| v.to_string().ok());
        if let (Some("linear"), Some(factor)) =
            (scaling.map(String::as_str), f("rope.scaling.factor"))
        {
            full = json!({"rope_type": "linear", "rope_theta": theta, "factor": factor});
        }
        let (bos, eos, pad) = self.token_ids();
        Ok(json!({
            "model_type": "gemma3_text",
            "vocab_size": self.vocab_size()?,
            "hidden_size": u("embedding_length")?,
            "intermediate_size": u("feed_forward_length")?,
            "num_hidden_layers": layers,
            "num_attention_heads": u("attention.head_count")?,
            "num_key_value_heads": u("attention.head_count_kv")?,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "sliding_window": u("attention.sliding_window")?,
            "rms_norm_eps": f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            "max_position_embeddings": u("context_length").unwrap_or(32768),
            "final_logit_softcapping": f("final_logit_softcapping"),
            "layer_types": layer_types,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": f("rope.freq_base_swa").unwrap_or(10_000.0)},
                "full_attention": full,
            },
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
        }))
    }

    /// `gemma4` metadata (llama.cpp's layout) as an equivalent Hugging Face `gemma4_text` config.
    fn gemma4_config_json(&self) -> Result<Json> {
        let key = |k: &str| format!("gemma4.{k}");
        let u = |k: &str| self.require(&key(k));
        let layers = u("block_count")?;
        let sliding: Vec<bool> = match self.meta(&key("attention.sliding_window_pattern")) {
            Some(Value::Array(items)) if items.len() == layers => {
                items.iter().map(|b| b.to_bool().unwrap_or(true)).collect()
            }
            _ => return Err(self.meta_error(&key("attention.sliding_window_pattern"))),
        };
        let layer_types: Vec<&str> = sliding
            .iter()
            .map(|&s| {
                if s {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        let kv_heads = self.per_layer(&key("attention.head_count_kv"), layers)?;
        let ffn = self.per_layer(&key("feed_forward_length"), layers)?;
        let first_sliding = sliding.iter().position(|&s| s).unwrap_or(0);
        let first_full = sliding.iter().position(|&s| !s);
        let sliding_kv = kv_heads[first_sliding];
        let full_kv = first_full.map(|i| kv_heads[i]);
        // k = v layers store no attn_v; without tensors, a separate full-layer KV-head
        // count implies it (Hugging Face only honours that count together with k = v).
        let k_eq_v = match first_full {
            Some(i) if !self.content.tensor_infos.is_empty() => !self
                .content
                .tensor_infos
                .contains_key(&format!("blk.{i}.attn_v.weight")),
            _ => full_kv.is_some_and(|k| k != sliding_kv),
        };
        let base_ffn = ffn[0];
        let double_wide = ffn.iter().any(|&f| f == 2 * base_ffn);
        let experts = self.meta_usize(&key("expert_count")).unwrap_or(0);
        let vocab = self.vocab_size()?;
        let full_dim = u("attention.key_length")?;
        let rotated = self.rotated_fraction(full_dim)?;
        let (bos, eos, pad) = self.token_ids();
        Ok(json!({
            "model_type": "gemma4_text",
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "hidden_size": u("embedding_length")?,
            "intermediate_size": base_ffn,
            "use_double_wide_mlp": double_wide,
            "num_hidden_layers": layers,
            "num_attention_heads": u("attention.head_count")?,
            "num_key_value_heads": sliding_kv,
            "num_global_key_value_heads": if k_eq_v { full_kv } else { None },
            "attention_k_eq_v": k_eq_v,
            "head_dim": u("attention.key_length_swa")?,
            "global_head_dim": full_dim,
            "sliding_window": u("attention.sliding_window")?,
            "layer_types": layer_types,
            "num_kv_shared_layers": self.meta_usize(&key("attention.shared_kv_layers")).unwrap_or(0),
            "hidden_size_per_layer_input": self.meta_usize(&key("embedding_length_per_layer_input")).unwrap_or(0),
            "enable_moe_block": experts > 0,
            "num_experts": (experts > 0).then_some(experts),
            "top_k_experts": self.meta_usize(&key("expert_used_count")),
            "moe_intermediate_size": self.meta_usize(&key("expert_feed_forward_length")),
            "rms_norm_eps": self.meta_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            "final_logit_softcapping": self.meta_f32(&key("final_logit_softcapping")),
            "max_position_embeddings": self.meta_usize(&key("context_length")).unwrap_or(131_072),
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": self.meta_f32(&key("rope.freq_base_swa")).unwrap_or(10_000.0)},
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": self.meta_f32(&key("rope.freq_base")).unwrap_or(1_000_000.0),
                    "partial_rotary_factor": rotated,
                },
            },
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
        }))
    }

    /// Fraction of a full layer's frequency pairs that rotate: llama.cpp stores
    /// factor 1.0 for rotating pairs and a huge factor for the rest in
    /// `rope_freqs`; without that tensor, Gemma 4's published 0.25.
    fn rotated_fraction(&self, full_head_dim: usize) -> Result<f64> {
        if !self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Ok(0.25);
        }
        let half = full_head_dim / 2;
        let factors = self.raw("rope_freqs.weight", &[half])?.to_f32()?;
        let rotating = factors.iter().take_while(|&&f| f == 1.0).count();
        Ok(2.0 * rotating as f64 / full_head_dim as f64)
    }

    fn meta_error(&self, key: &str) -> ModelError {
        WeightError::Format {
            path: self.path.display().to_string(),
            message: format!("GGUF metadata `{key}` is missing or not a number"),
        }
        .into()
    }

    /// A tensor by its GGUF name, as stored.
    pub(crate) fn raw(&self, gguf_name: &str, shape: &[usize]) -> Result<StoredTensor> {
        let info =
            self.content
                .tensor_infos
                .get(gguf_name)
                .ok_or_else(|| WeightError::Missing {
                    name: gguf_name.to_string(),
                })?;
        if info.shape.dims() != shape {
            return Err(WeightError::Shape {
                name: gguf_name.into(),
                expected: shape.to_vec(),
                found: info.shape.dims().to_vec(),
            }
            .into());
        }
        if let Ok(mut used) = self.used.lock() {
            used.insert(gguf_name.to_string());
        }
        let dtype = StoredDtype::Ggml(info.ggml_dtype);
        let len =
            crate::storage::expected_bytes(dtype, shape).ok_or_else(|| WeightError::Format {
                path: self.path.display().to_string(),
                message: format!(
                    "tensor `{gguf_name}` of shape {shape:?} does not divide into {} blocks",
                    dtype.name()
                ),
            })?;
        let start = usize::try_from(self.content.tensor_data_offset.saturating_add(info.offset))
            .unwrap_or(usize::MAX);
        let range = start..start.saturating_add(len);
        Ok(StoredTensor::mapped(
            gguf_name.to_string(),
            dtype,
            shape.to_vec(),
            &self.file,
            range,
        )?)
    }
}

/// Hugging Face text-model tensor name → llama.cpp GGUF name.
pub fn gguf_name(hf: &str) -> Option<String> {
    let global = match hf {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "embed_tokens_per_layer.weight" => Some("per_layer_token_embd.weight"),
        "per_layer_model_projection.weight" => Some("per_layer_model_proj.weight"),
        "per_layer_projection_norm.weight" => Some("per_layer_proj_norm.weight"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let mapped = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "layer_scalar" => "layer_output_scale.weight",
        "per_layer_input_gate.weight" => "inp_gate.weight",
        "per_layer_projection.weight" => "proj.weight",
        "post_per_layer_input_norm.weight" => "post_norm.weight",
        "router.proj.weight" => "ffn_gate_inp.weight",
        "router.scale" => "ffn_gate_inp.scale",
        "router.per_expert_scale" => "ffn_down_exps.scale",
        "experts.gate_up_proj" => "ffn_gate_up_exps.weight",
        "experts.down_proj" => "ffn_down_exps.weight",
        "pre_feedforward_layernorm_2.weight" => "pre_ffw_norm_2.weight",
        "post_feedforward_layernorm_1.weight" => "post_ffw_norm_1.weight",
        "post_feedforward_layernorm_2.weight" => "post_ffw_norm_2.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

impl WeightSource for GgufSource {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        let g = gguf_name(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
        })?;
        self.raw(&g, shape)
    }

    fn total_bytes(&self) -> u64 {
        self.file.len() as u64
    }

    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.content.tensor_infos.contains_key(&g))
    }

    fn norms_include_gemma3_offset(&self) -> bool {
        true
    }

    fn unused(&self) -> Vec<String> {
        let used = self.used.lock().map(|u| u.clone()).unwrap_or_default();
        let mut names: Vec<String> = self
            .content
            .tensor_infos
            .keys()
            .filter(|n| !used.contains(*n))
            .cloned()
            .collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// The real Gemma 4 vocabulary GGUF carries the 26B-A4B hyper-parameters
    /// in llama.cpp's layout; they must resolve to the published config.
    #[test]
    fn gemma4_metadata_resolves_to_the_published_26b_config() {
        let src = GgufSource::open(&root().join("tests/fixtures/text/ggml-vocab-gemma-4.gguf"))
            .expect("open");
        let from_gguf = src.config().expect("config");
        let published =
            TextConfig::from_dir(&root().join("tests/fixtures/configs/gemma-4-26B-A4B-it"))
                .expect("config");
        assert_eq!(from_gguf.layers, published.layers);
        assert_eq!(from_gguf.moe, published.moe);
        assert_eq!(from_gguf.hidden_size, published.hidden_size);
        assert_eq!(from_gguf.vocab_size, published.vocab_size);
        assert_eq!(from_gguf.sliding_window, published.sliding_window);
        assert_eq!(
            from_gguf.final_logit_softcapping,
            published.final_logit_softcapping
        );
        assert_eq!(from_gguf.ple_dim, 0);
    }
}
