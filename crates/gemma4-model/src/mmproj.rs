//! llama.cpp's multimodal projector files (`mmproj` GGUF, architecture
//! `clip`) for Gemma 4 as its converter writes them beside a text GGUF: the
//! vision tower (`gemma4v`) and the audio tower (`gemma4a`) of E2B/E4B, 31B
//! and 26B-A4B, and the 12B's encoder-free image and audio embedders
//! (`gemma4uv`, `gemma4ua`).
//!
//! The towers are written once, against the Hugging Face names; this source
//! answers those names from the file's (`v.blk.N.attn_q.weight` for
//! `vision_tower.encoder.layers.N.self_attn.q_proj.linear.weight`,
//! `v.patch_norm.3.weight` for `vision_embedder.pos_norm.weight`, and so
//! on) and undoes what the converter changed: the patch embedding stored as
//! a convolution kernel (channels first), the 12B's patch projection and
//! first patch norm with their pixel values reordered channels first, its
//! position table with the x and y tables as the outer axis, the audio query
//! scale stored with its softplus applied, scalars stored as one-element
//! vectors, the depthwise kernel without its middle axis. The settings the
//! converter does not write (head width, KV heads, clipping,
//! standardisation, the 12B's table size and frame width) are read from the
//! tensors; those llama.cpp fixes in code (the vision RoPE base 100, 3×3
//! pooling, the audio chunk of 12 with 12 past positions and a logit cap of
//! 50, the 12B's audio norm epsilon) are the published configuration's.

use std::path::Path;

use gemma4_kernels::float::FloatType;
use gemma4_kernels::Bytes;
use serde_json::{json, Value};

use crate::error::{ModelError, Result, WeightError};
use crate::gguf_source::GgufSource;
use crate::source::WeightSource;
use crate::storage::{StoredDtype, StoredTensor};

/// An mmproj file, answering the towers' Hugging Face names.
pub struct MmprojSource {
    gguf: GgufSource,
}

/// What a tensor needs besides its new name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fix {
    /// The same values; the shape may be written differently.
    None,
    /// Each row's pixel values stored channels first (`[D, 3, p, p]`, a
    /// convolution kernel; `[D, 3·p·p]` or `[3·p·p]` as the 12B's patch
    /// projection and first patch norm are written) back to channels last
    /// (`p·p` pixels of 3 values), as the reference's patch embedding reads.
    ChannelsFirst,
    /// `[2, T, D]` (the x table, then the y table) back to `[T, 2, D]` (per
    /// position, its x and y rows), the 12B's position table.
    PositionTables,
    /// Stored as `softplus(x)`; the tower applies softplus itself.
    Softplus,
}

impl MmprojSource {
    pub fn open(path: &Path) -> Result<Self> {
        let gguf = GgufSource::open(path)?;
        match gguf.architecture() {
            Some("clip") => Ok(Self { gguf }),
            other => Err(ModelError::Input(format!(
                "not a multimodal projector (architecture `{}`, expected `clip`)",
                other.unwrap_or("none")
            ))),
        }
    }

    fn text(&self, key: &str) -> Option<String> {
        self.gguf
            .meta(key)
            .and_then(|v| v.to_string().ok())
            .cloned()
    }

    /// The projector type of a modality (`gemma4v`, `gemma4a`, …), from the
    /// per-modality key or the shared one.
    fn projector(&self, modality: &str) -> Option<String> {
        self.text(&format!("clip.{modality}.projector_type"))
            .or_else(|| self.text("clip.projector_type"))
    }

    fn has(&self, modality: &str) -> bool {
        self.gguf
            .meta(&format!("clip.has_{modality}_encoder"))
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false)
    }

    fn require(&self, key: &str) -> Result<usize> {
        self.gguf.meta_usize(key).ok_or_else(|| self.missing(key))
    }

    fn missing(&self, what: &str) -> ModelError {
        ModelError::Input(format!(
            "{}: the multimodal projector lacks `{what}`",
            self.gguf.path().display()
        ))
    }

    fn dims(&self, name: &str) -> Result<Vec<usize>> {
        self.gguf.dims(name).ok_or_else(|| self.missing(name))
    }

    /// A `config.json` with the `vision_config` and `audio_config` of the
    /// towers this file holds, and the media token ids of `text_config`
    /// (the text checkpoint's `config.json`, or `{}` for Gemma 4's ids).
    pub fn config_json(&self, text_config: &Value) -> Result<Value> {
        let mut out = json!({});
        for key in [
            "image_token_id",
            "boi_token_id",
            "eoi_token_id",
            "video_token_id",
            "audio_token_id",
            "boa_token_id",
            "eoa_token_index",
            "eoa_token_id",
        ] {
            if let Some(v) = text_config.get(key) {
                out[key] = v.clone();
            }
        }
        if self.has("vision") {
            out["vision_config"] = match self.projector("vision").as_deref() {
                Some("gemma4v") => self.vision_config()?,
                Some("gemma4uv") => self.unified_vision_config()?,
                other => return Err(self.unsupported("vision", other)),
            };
        }
        if self.has("audio") {
            out["audio_config"] = match self.projector("audio").as_deref() {
                Some("gemma4a") => self.audio_config()?,
                Some("gemma4ua") => self.unified_audio_config()?,
                other => return Err(self.unsupported("audio", other)),
            };
        }
        Ok(out)
    }

    fn unsupported(&self, modality: &str, kind: Option<&str>) -> ModelError {
        ModelError::Input(format!(
            "{}: the {modality} projector `{}` is not supported (supported: gemma4v, gemma4a, \
             gemma4uv, gemma4ua)",
            self.gguf.path().display(),
            kind.unwrap_or("none")
        ))
    }

    fn vision_config(&self) -> Result<Value> {
        let hidden = self.require("clip.vision.embedding_length")?;
        let heads = self.require("clip.vision.attention.head_count")?;
        let head_dim = self.dims("v.blk.0.attn_q_norm.weight")?[0];
        let kv_rows = self.dims("v.blk.0.attn_k.weight")?[0];
        let table = self.dims("v.position_embd.weight")?;
        Ok(json!({
            "model_type": "gemma4_vision",
            "hidden_size": hidden,
            "intermediate_size": self.require("clip.vision.feed_forward_length")?,
            "num_hidden_layers": self.require("clip.vision.block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_rows / head_dim.max(1),
            "head_dim": head_dim,
            "rms_norm_eps": self.eps("vision"),
            "patch_size": self.require("clip.vision.patch_size")?,
            "pooling_kernel_size": self
                .gguf
                .meta_usize("clip.vision.projector.scale_factor")
                .unwrap_or(3),
            "position_embedding_size": table.get(1).copied().unwrap_or(0),
            "use_clipped_linears": self.gguf.dims("v.blk.0.attn_q.input_max").is_some(),
            "standardize": self.gguf.dims("v.std_bias").is_some(),
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        }))
    }

    /// The 12B's encoder-free image embedder: 48-pixel patches (the file's
    /// patch size times the merge factor, as llama.cpp reads it), the table
    /// size from the position table.
    fn unified_vision_config(&self) -> Result<Value> {
        let width = self.require("clip.vision.embedding_length")?;
        let table = self.dims("v.position_embd.weight")?;
        let [2, positions, d] = table[..] else {
            return Err(self.bad_shape("v.position_embd.weight", &table, "[2, T, D]"));
        };
        if d != width {
            return Err(self.bad_shape("v.position_embd.weight", &table, "[2, T, D]"));
        }
        Ok(json!({
            "model_type": "gemma4_unified_vision",
            "patch_size": self.require("clip.vision.patch_size")?,
            "pooling_kernel_size": self
                .gguf
                .meta_usize("clip.vision.projector.scale_factor")
                .unwrap_or(3),
            "mm_embed_dim": width,
            "output_proj_dims": width,
            "mm_posemb_size": positions,
            "rms_norm_eps": self.eps("vision"),
        }))
    }

    /// The 12B's encoder-free audio embedder: the frame width is the
    /// projection's input width (640 in the published model).
    fn unified_audio_config(&self) -> Result<Value> {
        let proj = self.dims("mm.a.input_projection.weight")?;
        let [_, frame] = proj[..] else {
            return Err(self.bad_shape("mm.a.input_projection.weight", &proj, "[H, frame]"));
        };
        Ok(json!({
            "model_type": "gemma4_unified_audio",
            "audio_embed_dim": frame,
            // llama.cpp reads 1e-6 whatever the file says.
            "rms_norm_eps": 1e-6,
        }))
    }

    fn bad_shape(&self, name: &str, found: &[usize], expected: &str) -> ModelError {
        ModelError::Input(format!(
            "{}: `{name}` has shape {found:?}, expected {expected}",
            self.gguf.path().display()
        ))
    }

    fn audio_config(&self) -> Result<Value> {
        let conv0 = self.dims("a.conv1d.0.weight")?;
        let conv1 = self.dims("a.conv1d.1.weight")?;
        let kernel = self.dims("a.blk.0.conv_dw.weight")?;
        let out = self.dims("a.pre_encode.out.weight")?;
        Ok(json!({
            "model_type": "gemma4_audio",
            "hidden_size": self.require("clip.audio.embedding_length")?,
            "num_hidden_layers": self.require("clip.audio.block_count")?,
            "num_attention_heads": self.require("clip.audio.attention.head_count")?,
            "hidden_act": "silu",
            "subsampling_conv_channels": [conv0[0], conv1[0]],
            "conv_kernel_size": kernel.last().copied().unwrap_or(5),
            "attention_chunk_size": 12,
            "attention_context_left": 13,
            "attention_context_right": 0,
            "attention_logit_cap": 50.0,
            "use_clipped_linears": self.gguf.dims("a.blk.0.attn_q.input_max").is_some(),
            // llama.cpp too reads 1e-6 whatever the file says.
            "rms_norm_eps": 1e-6,
            "output_proj_dims": out[0],
        }))
    }

    fn eps(&self, modality: &str) -> f64 {
        self.gguf
            .meta_f32(&format!("clip.{modality}.attention.layer_norm_epsilon"))
            .map_or(1e-6, f64::from)
    }
}

impl WeightSource for MmprojSource {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        let (g, fix) = mmproj_name(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
        })?;
        let dims = self.dims(&g)?;
        let elements: usize = shape.iter().product();
        if dims.iter().product::<usize>() != elements {
            return Err(WeightError::Shape {
                name: g,
                expected: shape.to_vec(),
                found: dims,
            }
            .into());
        }
        let t = self.gguf.raw(&g, &dims)?;
        let f32_tensor = |values: Vec<f32>| {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            StoredTensor::new(
                g.clone(),
                StoredDtype::Float(FloatType::F32),
                shape.to_vec(),
                Bytes::from_vec(bytes),
            )
        };
        Ok(match fix {
            Fix::None => {
                let mut t = t;
                t.shape = shape.to_vec();
                t
            }
            Fix::ChannelsFirst => {
                let bad = || WeightError::Shape {
                    name: g.clone(),
                    expected: shape.to_vec(),
                    found: dims.clone(),
                };
                // Rows and channels of the stored layout.
                let (rows, channels) = match dims[..] {
                    [d, c, _, _] => (d, c),
                    [d, _] => (d, 3),
                    [_] => (1, 3),
                    _ => return Err(bad().into()),
                };
                let row = elements / rows.max(1);
                if rows == 0 || channels == 0 || !row.is_multiple_of(channels) {
                    return Err(bad().into());
                }
                let pixels = row / channels;
                let v = t.to_f32()?;
                let mut out = vec![0f32; v.len()];
                for (dst, src) in out.chunks_exact_mut(row).zip(v.chunks_exact(row)) {
                    for ch in 0..channels {
                        for px in 0..pixels {
                            dst[px * channels + ch] = src[ch * pixels + px];
                        }
                    }
                }
                f32_tensor(out)
            }
            Fix::PositionTables => {
                let [2, positions, d] = dims[..] else {
                    return Err(WeightError::Shape {
                        name: g,
                        expected: shape.to_vec(),
                        found: dims,
                    }
                    .into());
                };
                if shape != [positions, 2, d] {
                    return Err(WeightError::Shape {
                        name: g,
                        expected: shape.to_vec(),
                        found: dims,
                    }
                    .into());
                }
                let v = t.to_f32()?;
                let mut out = vec![0f32; v.len()];
                for axis in 0..2 {
                    for p in 0..positions {
                        out[(p * 2 + axis) * d..][..d]
                            .copy_from_slice(&v[(axis * positions + p) * d..][..d]);
                    }
                }
                f32_tensor(out)
            }
            Fix::Softplus => {
                // x = ln(e^y − 1), the inverse of softplus, in double precision.
                let v = t.to_f32()?;
                f32_tensor(
                    v.iter()
                        .map(|&y| {
                            let y = f64::from(y);
                            (y + (-(-y).exp_m1()).ln()) as f32
                        })
                        .collect(),
                )
            }
        })
    }

    fn contains(&self, name: &str) -> bool {
        mmproj_name(name).is_some_and(|(g, _)| self.gguf.dims(&g).is_some())
    }

    fn total_bytes(&self) -> u64 {
        self.gguf.total_bytes()
    }
}

/// The mmproj name of a tower tensor named below the multimodal root
/// (`vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight` →
/// `v.blk.0.attn_q.weight`).
pub fn mmproj_tensor_name(hf: &str) -> Option<String> {
    mmproj_name(hf).map(|(g, _)| g)
}

/// The mmproj name of a tower tensor (named below the multimodal root, as
/// the towers ask for them), and what it needs.
fn mmproj_name(hf: &str) -> Option<(String, Fix)> {
    if let Some(rest) = hf.strip_prefix("vision_tower.") {
        return vision_name(rest);
    }
    if let Some(rest) = hf.strip_prefix("audio_tower.") {
        return audio_name(rest);
    }
    if let Some(rest) = hf.strip_prefix("vision_embedder.") {
        return unified_vision_name(rest);
    }
    let g = match hf {
        "embed_vision.embedding_projection.weight" => "mm.input_projection.weight",
        "embed_audio.embedding_projection.weight" => "mm.a.input_projection.weight",
        _ => return None,
    };
    Some((g.to_string(), Fix::None))
}

/// `q_proj.linear.weight` → (`attn_q`, `weight`); `q_proj.input_max` →
/// (`attn_q`, `input_max`): a clipped linear's weight and its clip values.
fn linear_part<'a>(rest: &'a str, names: &[(&str, &'a str)]) -> Option<(&'a str, &'a str)> {
    let (module, field) = rest.split_once('.')?;
    let (_, g) = names.iter().find(|(hf, _)| *hf == module)?;
    let field = match field {
        "linear.weight" | "weight" => "weight",
        f @ ("input_min" | "input_max" | "output_min" | "output_max" | "bias") => f,
        _ => return None,
    };
    Some((g, field))
}

/// The 12B's image embedder (`vision_embedder.*`): its three LayerNorms
/// are the converter's patch norms 1 to 3 (`pos_norm` the third), the dense
/// projection the patch embedding.
fn unified_vision_name(rest: &str) -> Option<(String, Fix)> {
    let (module, field) = rest.rsplit_once('.').unwrap_or((rest, ""));
    let (g, fix) = match (module, field) {
        ("pos_embedding", "") => ("v.position_embd.weight".to_string(), Fix::PositionTables),
        ("patch_dense", "weight") => ("v.patch_embd.weight".into(), Fix::ChannelsFirst),
        ("patch_dense", "bias") => ("v.patch_embd.bias".into(), Fix::None),
        ("patch_ln1" | "patch_ln2" | "pos_norm", "weight" | "bias") => {
            let n = match module {
                "patch_ln1" => 1,
                "patch_ln2" => 2,
                _ => 3,
            };
            // The first norm reads the pixel values, reordered as the
            // projection's columns are.
            let fix = if n == 1 {
                Fix::ChannelsFirst
            } else {
                Fix::None
            };
            (format!("v.patch_norm.{n}.{field}"), fix)
        }
        _ => return None,
    };
    Some((g, fix))
}

fn vision_name(rest: &str) -> Option<(String, Fix)> {
    let plain = |g: &str| Some((g.to_string(), Fix::None));
    match rest {
        "patch_embedder.input_proj.weight" => {
            return Some(("v.patch_embd.weight".into(), Fix::ChannelsFirst))
        }
        "patch_embedder.position_embedding_table" => return plain("v.position_embd.weight"),
        "std_bias" => return plain("v.std_bias"),
        "std_scale" => return plain("v.std_scale"),
        _ => {}
    }
    let rest = rest.strip_prefix("encoder.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let norm = match rest {
        "input_layernorm.weight" => Some("ln1"),
        "post_attention_layernorm.weight" => Some("attn_post_norm"),
        "pre_feedforward_layernorm.weight" => Some("ln2"),
        "post_feedforward_layernorm.weight" => Some("ffn_post_norm"),
        "self_attn.q_norm.weight" => Some("attn_q_norm"),
        "self_attn.k_norm.weight" => Some("attn_k_norm"),
        _ => None,
    };
    if let Some(n) = norm {
        return plain(&format!("v.blk.{layer}.{n}.weight"));
    }
    let (group, rest) = rest.split_once('.')?;
    let names: &[(&str, &str)] = match group {
        "self_attn" => &[
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
            ("o_proj", "attn_out"),
        ],
        "mlp" => &[
            ("gate_proj", "ffn_gate"),
            ("up_proj", "ffn_up"),
            ("down_proj", "ffn_down"),
        ],
        _ => return None,
    };
    let (g, field) = linear_part(rest, names)?;
    plain(&format!("v.blk.{layer}.{g}.{field}"))
}

fn audio_name(rest: &str) -> Option<(String, Fix)> {
    let plain = |g: String| Some((g, Fix::None));
    if let Some(sub) = rest.strip_prefix("subsample_conv_projection.") {
        return match sub {
            "input_proj_linear.weight" => plain("a.input_projection.weight".into()),
            _ => {
                let (layer, field) = sub.strip_prefix("layer")?.split_once('.')?;
                let layer: usize = layer.parse().ok()?;
                match field {
                    "conv.weight" => plain(format!("a.conv1d.{layer}.weight")),
                    "norm.weight" => plain(format!("a.conv1d.{layer}.norm.weight")),
                    _ => None,
                }
            }
        };
    }
    match rest {
        "output_proj.weight" => return plain("a.pre_encode.out.weight".into()),
        "output_proj.bias" => return plain("a.pre_encode.out.bias".into()),
        _ => {}
    }
    let rest = rest.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let blk = |g: &str| format!("a.blk.{layer}.{g}");
    let fixed = match rest {
        "norm_pre_attn.weight" => Some("attn_pre_norm.weight"),
        "norm_post_attn.weight" => Some("attn_post_norm.weight"),
        "norm_out.weight" => Some("ln2.weight"),
        "self_attn.relative_k_proj.weight" => Some("attn_k_rel.weight"),
        // The converter's names swap these two: `conv_norm` is the norm
        // before the convolution block, `norm_conv` the one after the
        // depthwise convolution.
        "lconv1d.pre_layer_norm.weight" => Some("conv_norm.weight"),
        "lconv1d.conv_norm.weight" => Some("norm_conv.weight"),
        "lconv1d.depthwise_conv1d.weight" => Some("conv_dw.weight"),
        _ => None,
    };
    if let Some(g) = fixed {
        return plain(blk(g));
    }
    if rest == "self_attn.per_dim_scale" {
        return Some((blk("per_dim_scale.weight"), Fix::Softplus));
    }
    let (group, rest) = rest.split_once('.')?;
    let (names, suffix): (&[(&str, &str)], &str) = match group {
        "feed_forward1" | "feed_forward2" => (
            &[
                ("pre_layer_norm", "ffn_norm"),
                ("ffw_layer_1", "ffn_up"),
                ("ffw_layer_2", "ffn_down"),
                ("post_layer_norm", "ffn_post_norm"),
            ],
            if group == "feed_forward2" { "_1" } else { "" },
        ),
        "self_attn" => (
            &[
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
                ("post", "attn_out"),
            ],
            "",
        ),
        "lconv1d" => (
            &[("linear_start", "conv_pw1"), ("linear_end", "conv_pw2")],
            "",
        ),
        _ => return None,
    };
    let (g, field) = linear_part(rest, names)?;
    plain(blk(&format!("{g}{suffix}.{field}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tower_names_map_to_the_converter_names() {
        for (hf, g) in [
            (
                "vision_tower.encoder.layers.3.self_attn.q_proj.linear.weight",
                "v.blk.3.attn_q.weight",
            ),
            (
                "vision_tower.encoder.layers.0.self_attn.o_proj.output_max",
                "v.blk.0.attn_out.output_max",
            ),
            (
                "vision_tower.encoder.layers.1.mlp.down_proj.input_min",
                "v.blk.1.ffn_down.input_min",
            ),
            (
                "vision_tower.encoder.layers.1.post_feedforward_layernorm.weight",
                "v.blk.1.ffn_post_norm.weight",
            ),
            (
                "audio_tower.layers.2.feed_forward2.ffw_layer_1.linear.weight",
                "a.blk.2.ffn_up_1.weight",
            ),
            (
                "audio_tower.layers.2.feed_forward1.post_layer_norm.weight",
                "a.blk.2.ffn_post_norm.weight",
            ),
            (
                "audio_tower.layers.0.lconv1d.linear_end.input_max",
                "a.blk.0.conv_pw2.input_max",
            ),
            (
                "audio_tower.layers.0.lconv1d.pre_layer_norm.weight",
                "a.blk.0.conv_norm.weight",
            ),
            (
                "audio_tower.subsample_conv_projection.layer1.norm.weight",
                "a.conv1d.1.norm.weight",
            ),
            (
                "embed_audio.embedding_projection.weight",
                "mm.a.input_projection.weight",
            ),
            ("vision_embedder.patch_ln1.bias", "v.patch_norm.1.bias"),
            ("vision_embedder.patch_ln2.weight", "v.patch_norm.2.weight"),
            ("vision_embedder.pos_norm.bias", "v.patch_norm.3.bias"),
            ("vision_embedder.patch_dense.weight", "v.patch_embd.weight"),
            ("vision_embedder.patch_dense.bias", "v.patch_embd.bias"),
            ("vision_embedder.pos_embedding", "v.position_embd.weight"),
            (
                "embed_vision.embedding_projection.weight",
                "mm.input_projection.weight",
            ),
        ] {
            assert_eq!(mmproj_name(hf).map(|(n, _)| n).as_deref(), Some(g), "{hf}");
        }
        assert_eq!(
            mmproj_name("audio_tower.layers.0.self_attn.per_dim_scale").map(|(_, f)| f),
            Some(Fix::Softplus)
        );
        for (hf, fix) in [
            (
                "vision_tower.patch_embedder.input_proj.weight",
                Fix::ChannelsFirst,
            ),
            ("vision_embedder.patch_dense.weight", Fix::ChannelsFirst),
            ("vision_embedder.patch_ln1.weight", Fix::ChannelsFirst),
            ("vision_embedder.patch_ln2.weight", Fix::None),
            ("vision_embedder.pos_embedding", Fix::PositionTables),
        ] {
            assert_eq!(mmproj_name(hf).map(|(_, f)| f), Some(fix), "{hf}");
        }
        assert!(mmproj_name("vision_embedder.patch_ln4.weight").is_none());
        assert!(mmproj_name("vision_embedder.pos_embedding.weight").is_none());
        assert!(mmproj_name("language_model.layers.0.mlp.up_proj.weight").is_none());
        assert!(mmproj_name("vision_tower.encoder.layers.x.mlp.up_proj.linear.weight").is_none());
    }

    #[test]
    fn inverse_softplus_round_trips() {
        for x in [-3.0f64, -0.5, 0.0, 0.7, 4.0] {
            let y = (1.0 + x.exp()).ln();
            let back = y + (-(-y).exp_m1()).ln();
            assert!((back - x).abs() < 1e-12, "{x} → {y} → {back}");
        }
    }
}
