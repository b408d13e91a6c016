//! llama.cpp GGUF checkpoints of the `gemma3` architecture.
//!
//! The hyper-parameters come from `gemma3.*` metadata and are turned into
//! the same [`TextConfig`] a Hugging Face `config.json` gives; tensors are
//! found under their GGUF names (`blk.N.attn_q.weight`, …). Matrices stay
//! quantized and run through candle's quantized matmul, unless the source is
//! opened with [`GgufMode::Dequantized`] for exact f32 arithmetic.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value as Json};

use crate::config::TextConfig;
use crate::error::{ModelError, Result, WeightError};
use crate::layers::{Linear, LinearWeight};
use crate::source::WeightSource;

/// How weight matrices are kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufMode {
    /// Quantized blocks, computed with candle's quantized kernels (fast, small).
    Quantized,
    /// Every tensor dequantized to f32 at load (exact against an f32 reference).
    Dequantized,
}

/// An open GGUF file.
pub struct GgufSource {
    path: PathBuf,
    content: Content,
    reader: Mutex<BufReader<File>>,
    mode: GgufMode,
    used: Mutex<BTreeSet<String>>,
}

impl GgufSource {
    pub fn open(path: &Path, mode: GgufMode) -> Result<Self> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|source| WeightError::Io { path: shown.clone(), source })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| WeightError::Format {
            path: shown.clone(),
            message: format!("not a readable GGUF file: {e}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader: Mutex::new(reader),
            mode,
            used: Mutex::new(BTreeSet::new()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).map(String::as_str)
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// The text configuration described by the metadata.
    pub fn config(&self) -> Result<TextConfig> {
        let arch = self.architecture().unwrap_or("");
        if arch != "gemma3" {
            return Err(ModelError::Input(format!(
                "{}: GGUF architecture `{arch}` is not supported (supported: gemma3)",
                self.path.display()
            )));
        }
        let json = self.hf_config_json()?;
        Ok(TextConfig::from_hf_json(&json)?)
    }

    /// The metadata as an equivalent Hugging Face `gemma3_text` config.
    fn hf_config_json(&self) -> Result<Json> {
        let u = |key: &str| -> Result<usize> {
            let full = format!("gemma3.{key}");
            self.content
                .metadata
                .get(&full)
                .and_then(|v| v.to_u32().ok().map(|x| x as usize).or_else(|| v.to_u64().ok().map(|x| x as usize)))
                .ok_or_else(|| self.meta_error(&full))
        };
        let f = |key: &str| self.content.metadata.get(&format!("gemma3.{key}")).and_then(|v| v.to_f32().ok());
        let vocab = self
            .content
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .ok_or_else(|| WeightError::Missing { name: "token_embd.weight".into() })?;
        let layers = u("block_count")?;
        let head_dim = u("attention.key_length")?;
        // llama.cpp hard-codes the 5:1 pattern for gemma3: layer i is global iff i % 6 == 5.
        let layer_types: Vec<&str> =
            (0..layers).map(|i| if i % 6 == 5 { "full_attention" } else { "sliding_attention" }).collect();
        let mut full = json!({"rope_type": "default", "rope_theta": f("rope.freq_base").unwrap_or(1_000_000.0)});
        let scaling = self.content.metadata.get("gemma3.rope.scaling.type").and_then(|v| v.to_string().ok());
        if let (Some("linear"), Some(factor)) = (scaling.map(String::as_str), f("rope.scaling.factor")) {
            full = json!({"rope_type": "linear", "rope_theta": f("rope.freq_base").unwrap_or(1_000_000.0), "factor": factor});
        }
        let token = |k: &str| self.content.metadata.get(&format!("tokenizer.ggml.{k}")).and_then(|v| v.to_u32().ok());
        Ok(json!({
            "model_type": "gemma3_text",
            "vocab_size": vocab,
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
            "bos_token_id": token("bos_token_id"),
            "eos_token_id": token("eos_token_id"),
            "pad_token_id": token("padding_token_id"),
        }))
    }

    fn meta_error(&self, key: &str) -> ModelError {
        WeightError::Format {
            path: self.path.display().to_string(),
            message: format!("GGUF metadata `{key}` is missing or not a number"),
        }
        .into()
    }

    fn qtensor(&self, gguf_name: &str, shape: &[usize]) -> Result<QTensor> {
        let info = self
            .content
            .tensor_infos
            .get(gguf_name)
            .ok_or_else(|| WeightError::Missing { name: gguf_name.to_string() })?;
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
        let mut reader = self
            .reader
            .lock()
            .map_err(|_| ModelError::Input("GGUF reader lock poisoned".into()))?;
        self.content.tensor(&mut *reader, gguf_name, &Device::Cpu).map_err(|e| {
            WeightError::Format { path: self.path.display().to_string(), message: format!("tensor `{gguf_name}`: {e}") }
                .into()
        })
    }
}

/// Hugging Face text-model tensor name → llama.cpp GGUF name.
pub fn gguf_name(hf: &str) -> Option<String> {
    let global = match hf {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
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
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

impl WeightSource for GgufSource {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let g = gguf_name(name).ok_or_else(|| WeightError::Missing { name: name.to_string() })?;
        let q = self.qtensor(&g, shape)?;
        Ok(q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        let g = gguf_name(name).ok_or_else(|| WeightError::Missing { name: name.to_string() })?;
        let q = self.qtensor(&g, &[out, inp])?;
        // candle's dot products for these legacy block types are scalar code;
        // its f32 matmul is several times faster, so they are widened at load.
        let slow_kernel = matches!(q.dtype(), GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1);
        match self.mode {
            GgufMode::Quantized if !slow_kernel => {
                Ok(Linear::new(LinearWeight::Quantized(Arc::new(QMatMul::from_qtensor(q)?)), out))
            }
            _ => Linear::dense(q.dequantize(&Device::Cpu)?),
        }
    }

    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.content.tensor_infos.contains_key(&g))
    }

    fn norms_include_gemma3_offset(&self) -> bool {
        true
    }

    fn unused(&self) -> Vec<String> {
        let used = self.used.lock().map(|u| u.clone()).unwrap_or_default();
        let mut names: Vec<String> =
            self.content.tensor_infos.keys().filter(|n| !used.contains(*n)).cloned().collect();
        names.sort();
        names
    }
}
