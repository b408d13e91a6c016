//! llama.cpp's GGUF LoRA files, as its `convert_lora_to_gguf.py` writes
//! them: `general.type` `adapter`, `adapter.type` `lora`, the architecture
//! of the base model, `adapter.lora.alpha`, and for each adapted matrix
//! `blk.N.attn_q.weight.lora_a` (`[r, in]`) and `….lora_b` (`[out, r]`).
//! The scaling is llama.cpp's: `alpha / r`, with `r` each module's own
//! rank, or 1 where the file gives no alpha (the converter keeps neither
//! rsLoRA nor PEFT's per-module alphas). Factors in f32, f16 or bf16 are
//! kept as stored; other block types (the converter's `q8_0`) are widened
//! to f32 once, at load.

use std::io::Read;
use std::path::Path;

use candle_core::quantized::GgmlDType;

use super::{Halves, Projection, ReadAdapter, Scaling, StoredFactor};
use crate::error::{ModelError, Result};
use crate::gguf_source::GgufSource;
use crate::storage::StoredDtype;
use gemma4_kernels::float::FloatType;
use gemma4_kernels::Bytes;

/// Whether `path` is a file that starts as a GGUF file does.
pub(super) fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

pub(super) fn read(path: &Path) -> Result<ReadAdapter> {
    let shown = path.display().to_string();
    let file = GgufSource::open(path)?;
    let bad = |why: String| ModelError::Input(format!("{shown}: {why}"));
    let text = |key: &str| {
        file.metadata()
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
    };
    match text("general.type") {
        Some("adapter") => {}
        other => {
            return Err(bad(format!(
                "is not a LoRA adapter (`general.type` is {}; llama.cpp's \
                 convert_lora_to_gguf.py writes `adapter`)",
                other.map_or("missing".into(), |t| format!("`{t}`"))
            )))
        }
    }
    if text("adapter.type") != Some("lora") {
        return Err(bad("`adapter.type` is not `lora`".into()));
    }
    match text("general.architecture") {
        Some("gemma3" | "gemma4") => {}
        other => {
            return Err(bad(format!(
                "adapts a `{}` model, not Gemma 3 or 4",
                other.unwrap_or("unnamed")
            )))
        }
    }
    if file
        .metadata()
        .contains_key("adapter.alora_invocation_tokens")
    {
        return Err(bad(
            "is an activated LoRA (`adapter.alora_invocation_tokens`), which is not supported"
                .into(),
        ));
    }
    let alpha = match file.metadata().get("adapter.lora.alpha") {
        None => 0.0,
        Some(v) => f64::from(
            v.to_f32()
                .map_err(|_| bad("`adapter.lora.alpha` is not a float".into()))?,
        ),
    };
    let mut names: Vec<&str> = file.tensor_names().collect();
    names.sort_unstable();
    let mut halves = Halves::new();
    for name in names {
        let (layer, proj, is_a) =
            parse_name(name).map_err(|why| bad(format!("tensor `{name}` {why}")))?;
        let factor = factor(&file, name).map_err(|why| bad(format!("tensor `{name}` {why}")))?;
        let entry = halves.entry((layer, proj)).or_default();
        if is_a {
            entry.0 = Some(factor);
        } else {
            entry.1 = Some(factor);
        }
    }
    Ok(ReadAdapter {
        path: path.to_path_buf(),
        shown,
        halves,
        scaling: Box::new(AlphaOverRank(alpha)),
    })
}

/// llama.cpp's scaling: `alpha / r`, or 1 without an alpha.
struct AlphaOverRank(f64);

impl Scaling for AlphaOverRank {
    fn scale(&self, _module: &str, rank: usize) -> Result<f64> {
        Ok(if self.0 == 0.0 {
            1.0
        } else {
            self.0 / rank as f64
        })
    }
}

/// One factor, its bytes read from the file.
fn factor(file: &GgufSource, name: &str) -> std::result::Result<StoredFactor, String> {
    let dims = file.dims(name).unwrap_or_default();
    let [rows, cols] = dims[..] else {
        return Err(format!("has shape {dims:?}; a LoRA factor is a matrix"));
    };
    let stored = file.raw(name, &dims).map_err(|e| e.to_string())?;
    let kept = match stored.dtype {
        StoredDtype::Float(t) => Some(t),
        StoredDtype::Ggml(GgmlDType::F32) => Some(FloatType::F32),
        StoredDtype::Ggml(GgmlDType::F16) => Some(FloatType::F16),
        StoredDtype::Ggml(GgmlDType::BF16) => Some(FloatType::Bf16),
        StoredDtype::Ggml(_) => None,
    };
    Ok(match kept {
        Some(ty) => {
            let mut bytes = vec![0u8; stored.bytes.len()];
            stored.copy_to(&mut bytes).map_err(|e| e.to_string())?;
            StoredFactor {
                bytes: Bytes::from_vec(bytes),
                ty,
                shape: [rows, cols],
            }
        }
        None => {
            let values = stored.to_f32().map_err(|e| e.to_string())?;
            StoredFactor::encode(values.into_iter(), FloatType::F32, [rows, cols])
        }
    })
}

/// `(layer, projection, is lora_a)` of a tensor's name, or why it cannot
/// be applied.
fn parse_name(name: &str) -> std::result::Result<(usize, Projection, bool), String> {
    let (base, is_a) = if let Some(b) = name.strip_suffix(".lora_a") {
        (b, true)
    } else if let Some(b) = name.strip_suffix(".lora_b") {
        (b, false)
    } else if name.ends_with("_norm.weight") {
        return Err(
            "is a norm vector; adapters that change norms (mergekit's) are not supported".into(),
        );
    } else {
        return Err("is not a LoRA factor (`.lora_a` / `.lora_b`)".into());
    };
    let parts: Vec<&str> = base.split('.').collect();
    if let ["blk", n, matrix, "weight"] = parts[..] {
        let proj = match matrix {
            "attn_q" => Some(Projection::Q),
            "attn_k" => Some(Projection::K),
            "attn_v" => Some(Projection::V),
            "attn_output" => Some(Projection::O),
            "ffn_gate" => Some(Projection::Gate),
            "ffn_up" => Some(Projection::Up),
            "ffn_down" => Some(Projection::Down),
            _ => None,
        };
        if let (Ok(layer), Some(proj)) = (n.parse(), proj) {
            return Ok((layer, proj, is_a));
        }
        if matrix.contains("exps") || matrix.starts_with("ffn_gate_inp") {
            return Err(super::EXPERTS_REFUSED.into());
        }
    }
    if base.starts_with("token_embd") || base.starts_with("output") {
        return Err(
            "adapts the embeddings or the head; only the attention and MLP \
             projections can be adapted"
                .into(),
        );
    }
    Err(
        "adapts a matrix that cannot be adapted: only each layer's attn_q/k/v/output \
         and ffn_gate/up/down are"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_to_the_projections_llama_cpp_adapts() {
        assert_eq!(
            parse_name("blk.3.attn_output.weight.lora_b"),
            Ok((3, Projection::O, false))
        );
        assert_eq!(
            parse_name("blk.0.ffn_down.weight.lora_a"),
            Ok((0, Projection::Down, true))
        );
        for (name, why) in [
            ("blk.1.attn_norm.weight", "norm vector"),
            ("blk.1.ffn_gate_exps.weight.lora_a", "mixture of experts"),
            ("token_embd.weight.lora_a", "embeddings"),
            ("blk.1.attn_q.weight", "not a LoRA factor"),
            ("blk.x.attn_q.weight.lora_a", "cannot be adapted"),
        ] {
            let err = parse_name(name).expect_err(name);
            assert!(err.contains(why), "{name}: {err}");
        }
    }
}
