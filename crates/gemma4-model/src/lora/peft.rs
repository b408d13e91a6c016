//! PEFT adapter folders: `adapter_config.json` beside
//! `adapter_model.safetensors`. The scaling is `lora_alpha / r`
//! (`lora_alpha / √r` with rsLoRA), `r` and `lora_alpha` overridden per
//! module by `rank_pattern` and `alpha_pattern` as PEFT resolves them;
//! settings that change the computation otherwise (DoRA, biases, modules
//! saved whole, …) are refused by name.

use std::path::Path;

use gemma4_kernels::float::FloatType;
use gemma4_kernels::Bytes;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;

use super::{Halves, Projection, ReadAdapter, Scaling, StoredFactor};
use crate::error::{ModelError, Result};

/// Reads the folder `path` (or the folder of its `adapter_config.json`).
pub(super) fn read(path: &Path) -> Result<ReadAdapter> {
    let dir = if path.is_file() {
        path.parent().unwrap_or(Path::new("."))
    } else {
        path
    };
    let config_path = dir.join("adapter_config.json");
    let settings = AdapterSettings::read(&config_path)?;
    let weights_path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights_path).map_err(|e| {
        let hint = if dir.join("adapter_model.bin").is_file() {
            " (only safetensors adapters are read; PEFT writes them by default)"
        } else {
            ""
        };
        ModelError::Input(format!(
            "cannot read LoRA weights {}: {e}{hint}",
            weights_path.display()
        ))
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| {
        ModelError::Input(format!(
            "{} is not a usable safetensors file: {e}",
            weights_path.display()
        ))
    })?;
    let shown = weights_path.display().to_string();
    let halves = read_factors(&file, &shown)?;
    Ok(ReadAdapter {
        path: dir.to_path_buf(),
        shown,
        halves,
        scaling: Box::new(settings),
    })
}

/// `(layer, projection, is lora_A)` of an adapter tensor's name, or why it
/// cannot be applied.
fn parse_name(name: &str) -> std::result::Result<(usize, Projection, bool), String> {
    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
    let rest = ["model.language_model.", "language_model.model.", "model."]
        .iter()
        .find_map(|p| rest.strip_prefix(p))
        .unwrap_or(rest);
    let (module, is_a) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, true)
    } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
        (m, false)
    } else if rest.contains("lora_magnitude_vector") {
        return Err("is a DoRA magnitude; DoRA adapters are not supported".into());
    } else if rest.contains("lora_embedding") {
        return Err("adapts an embedding; only the attention and MLP projections can be".into());
    } else {
        return Err(
            "is not a LoRA factor (only `lora_A.weight` / `lora_B.weight` of the attention \
             and MLP projections are read; modules saved whole are not supported)"
                .into(),
        );
    };
    let parts: Vec<&str> = module.split('.').collect();
    if let ["layers", n, parent, proj] = parts[..] {
        let layer = n
            .parse()
            .map_err(|_| format!("names layer `{n}`, which is not a number"))?;
        if let Some(p) = Projection::from_name(parent, proj) {
            return Ok((layer, p, is_a));
        }
    }
    if module.contains("experts") || module.contains("router") {
        return Err(super::EXPERTS_REFUSED.into());
    }
    Err(
        "adapts a module that cannot be adapted: only the text decoder's \
         q/k/v/o_proj and gate/up/down_proj are"
            .into(),
    )
}

fn read_factors(file: &SafeTensors<'_>, shown: &str) -> Result<Halves> {
    let mut halves = Halves::new();
    for (tensor_name, view) in file.tensors() {
        let bad = |why: String| ModelError::Input(format!("{shown}: `{tensor_name}` {why}"));
        let (layer, proj, is_a) = parse_name(&tensor_name).map_err(bad)?;
        let ty = match view.dtype() {
            Dtype::F32 => FloatType::F32,
            Dtype::BF16 => FloatType::Bf16,
            Dtype::F16 => FloatType::F16,
            other => {
                return Err(bad(format!(
                    "is stored as {other:?}; LoRA factors are read in bf16, f16 or f32"
                )))
            }
        };
        let [rows, cols] = view.shape()[..] else {
            return Err(bad(format!(
                "has shape {:?}; a LoRA factor is a matrix",
                view.shape()
            )));
        };
        let factor = StoredFactor {
            bytes: Bytes::from_vec(view.data().to_vec()),
            ty,
            shape: [rows, cols],
        };
        let entry = halves.entry((layer, proj)).or_default();
        if is_a {
            entry.0 = Some(factor);
        } else {
            entry.1 = Some(factor);
        }
    }
    Ok(halves)
}

/// The parts of `adapter_config.json` that decide the computation.
struct AdapterSettings {
    /// `adapter_config.json`, for messages.
    path: std::path::PathBuf,
    r: f64,
    alpha: f64,
    rslora: bool,
    /// In the file's order.
    rank_pattern: Vec<(regex::Regex, f64)>,
    alpha_pattern: Vec<(regex::Regex, f64)>,
}

impl AdapterSettings {
    fn read(path: &Path) -> Result<Self> {
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Input(format!("cannot read {shown}: {e}")))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Input(format!("{shown} is not valid JSON: {e}")))?;
        let Value::Object(fields) = json else {
            return Err(ModelError::Input(format!("{shown} is not a JSON object")));
        };
        let bad = |field: &str, why: &str| ModelError::Input(format!("{shown}: `{field}` {why}"));
        match fields.get("peft_type").and_then(|v| v.as_str()) {
            Some("LORA") | None => {}
            Some(other) => {
                return Err(bad(
                    "peft_type",
                    &format!("is {other}; only LORA adapters are read"),
                ))
            }
        }
        let truthy = |v: &Value| match v {
            Value::Null | Value::Bool(false) => false,
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
            Value::String(s) => !s.is_empty() && s != "none",
            _ => true,
        };
        for (field, what) in [
            ("use_dora", "DoRA"),
            ("lora_bias", "LoRA biases"),
            ("bias", "trained biases"),
            ("fan_in_fan_out", "transposed (fan_in_fan_out) factors"),
            ("modules_to_save", "modules saved whole"),
            ("target_parameters", "adapted parameters (MoE experts)"),
            ("layer_replication", "layer replication"),
            ("trainable_token_indices", "trained token embeddings"),
            ("alora_invocation_tokens", "activated LoRA"),
            ("use_qalora", "QA-LoRA"),
        ] {
            if fields.get(field).is_some_and(&truthy) {
                return Err(bad(
                    field,
                    &format!("asks for {what}, which is not supported"),
                ));
            }
        }
        let number = |field: &str| -> Result<f64> {
            fields
                .get(field)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| bad(field, "is missing or not a number"))
        };
        let pattern = |field: &str| -> Result<Vec<(regex::Regex, f64)>> {
            let Some(v) = fields.get(field) else {
                return Ok(Vec::new());
            };
            // The crate keeps objects in the file's order (serde_json's
            // `preserve_order`): PEFT takes the first key that matches.
            let pairs = match v {
                Value::Null => return Ok(Vec::new()),
                Value::Object(o) => o,
                _ => return Err(bad(field, "is not an object")),
            };
            pairs
                .iter()
                .map(|(key, value)| {
                    let re = regex::Regex::new(&format!(r"^(.*\.)?({key})$")).map_err(|e| {
                        bad(
                            field,
                            &format!("key `{key}` is not a regular expression: {e}"),
                        )
                    })?;
                    let n = value
                        .as_f64()
                        .ok_or_else(|| bad(field, &format!("value of `{key}` is not a number")))?;
                    Ok((re, n))
                })
                .collect()
        };
        Ok(Self {
            path: path.to_path_buf(),
            r: number("r")?,
            alpha: number("lora_alpha")?,
            rslora: fields
                .get("use_rslora")
                .is_some_and(|v| v.as_bool() == Some(true)),
            rank_pattern: pattern("rank_pattern")?,
            alpha_pattern: pattern("alpha_pattern")?,
        })
    }

    /// PEFT's scaling of `module`, whose factors have rank `rank`.
    fn peft_scale(&self, module: &str, rank: usize) -> std::result::Result<f64, String> {
        let find = |pattern: &[(regex::Regex, f64)], default: f64| {
            pattern
                .iter()
                .find(|(re, _)| re.is_match(module))
                .map_or(default, |&(_, v)| v)
        };
        let r = find(&self.rank_pattern, self.r);
        let alpha = find(&self.alpha_pattern, self.alpha);
        if r != rank as f64 {
            return Err(format!(
                "the config gives rank {r}, but lora_A has {rank} rows"
            ));
        }
        if r <= 0.0 {
            return Err(format!("rank {r} is not positive"));
        }
        Ok(if self.rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        })
    }
}

impl Scaling for AdapterSettings {
    fn scale(&self, module: &str, rank: usize) -> Result<f64> {
        self.peft_scale(module, rank)
            .map_err(|why| ModelError::Input(format!("{}: {module}: {why}", self.path.display())))
    }
}
