//! The 12B's (`gemma4_unified`) encoder-free image path, mirroring the
//! reference's `Gemma4UnifiedVisionEmbedder`: 48-pixel patches (3×3 blocks of
//! the 16-pixel patches) → LayerNorm → dense (with bias) → LayerNorm → + the
//! x and y rows of the position table → LayerNorm → RMSNorm without scale →
//! `embedding_projection` into the text width. One soft token per patch.
//!
//! Published checkpoints keep it under `model.vision_embedder.*` (the
//! projection as `model.embed_vision.embedding_projection`); transformers'
//! module paths (`model.embed_vision.patch_ln1`, …,
//! `model.embed_vision.multimodal_embedder.embedding_projection`) load too.

use candle_core::{Device, Tensor, D};
use serde_json::Value;

use crate::error::{ConfigError, ModelError, Result};
use crate::layers::RmsNorm;
use crate::loader::Weights;
use crate::storage::Linear;
use crate::vision::{MediaTokens, VisionInput};

/// `vision_config` of a `gemma4_unified` checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct UnifiedVisionConfig {
    /// Pixels of a merged patch side (`patch_size · pooling_kernel_size`).
    pub patch_pixels: usize,
    /// The image processor's patch side and the blocks it merges.
    pub patch_size: usize,
    pub pooling: usize,
    pub embed_dim: usize,
    pub position_table_size: usize,
    pub rms_norm_eps: f64,
    pub tokens: MediaTokens,
    /// A video frame's soft-token placeholder (`video_token_id`).
    pub video_soft: u32,
}

impl UnifiedVisionConfig {
    pub fn from_hf_json(
        v: &Value,
        tokens: MediaTokens,
        video_soft: u32,
    ) -> std::result::Result<Self, ConfigError> {
        let num = |key: &str, default: usize| -> std::result::Result<usize, ConfigError> {
            match v.get(key) {
                None => Ok(default),
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    ConfigError::invalid(format!("vision_config.{key}"), "must be a whole number")
                }),
            }
        };
        let embed_dim = num("mm_embed_dim", 3840)?;
        if num("output_proj_dims", embed_dim)? != embed_dim {
            return Err(ConfigError::invalid(
                "vision_config.output_proj_dims",
                "must equal mm_embed_dim (the projection reads the embedder's output)",
            ));
        }
        let patch_size = crate::vision::at_least_one(num("patch_size", 16)?, "patch_size")?;
        let pooling =
            crate::vision::at_least_one(num("pooling_kernel_size", 3)?, "pooling_kernel_size")?;
        Ok(Self {
            patch_pixels: patch_size * pooling,
            patch_size,
            pooling,
            embed_dim,
            position_table_size: num("mm_posemb_size", 1120)?,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            tokens,
            video_soft,
        })
    }
}

/// `LayerNorm` with weight and bias, eps 1e-5 (PyTorch's default, which the
/// reference keeps), over the last dimension in f32.
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    const EPS: f64 = 1e-5;

    fn load(src: &Weights<'_>, name: &str, dim: usize) -> Result<Self> {
        Ok(Self {
            weight: src.vector(&format!("{name}.weight"), &[dim])?,
            bias: src.vector(&format!("{name}.bias"), &[dim])?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + Self::EPS)?.sqrt()?)?;
        Ok(normed
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)?)
    }
}

/// The encoder-free embedder.
pub struct UnifiedVisionEmbedder {
    cfg: UnifiedVisionConfig,
    patch_ln1: LayerNorm,
    patch_dense: Linear,
    patch_dense_bias: Tensor,
    patch_ln2: LayerNorm,
    /// `[table, 2, D]`: per position, the x row then the y row.
    position_table: Vec<f32>,
    pos_norm: LayerNorm,
    projection: Linear,
    device: Device,
}

impl UnifiedVisionEmbedder {
    pub fn load(cfg: UnifiedVisionConfig, text_hidden: usize, src: &Weights<'_>) -> Result<Self> {
        let d = cfg.embed_dim;
        let values = cfg.patch_pixels * cfg.patch_pixels * 3;
        let p = ["vision_embedder.", "embed_vision."]
            .into_iter()
            .find(|p| src.contains(&format!("{p}patch_dense.weight")))
            .unwrap_or("vision_embedder.");
        let projection = [
            "embed_vision.embedding_projection.weight",
            "embed_vision.multimodal_embedder.embedding_projection.weight",
        ]
        .into_iter()
        .find(|n| src.contains(n))
        .unwrap_or("embed_vision.embedding_projection.weight");
        Ok(Self {
            patch_ln1: LayerNorm::load(src, &format!("{p}patch_ln1"), values)?,
            patch_dense: src.linear(&format!("{p}patch_dense.weight"), d, values)?,
            patch_dense_bias: src.vector(&format!("{p}patch_dense.bias"), &[d])?,
            patch_ln2: LayerNorm::load(src, &format!("{p}patch_ln2"), d)?,
            position_table: src
                .vector(
                    &format!("{p}pos_embedding"),
                    &[cfg.position_table_size, 2, d],
                )?
                .flatten_all()?
                .to_vec1::<f32>()?,
            pos_norm: LayerNorm::load(src, &format!("{p}pos_norm"), d)?,
            projection: src.linear(projection, text_hidden, d)?,
            cfg,
            device: Device::Cpu,
        })
    }

    pub fn config(&self) -> &UnifiedVisionConfig {
        &self.cfg
    }

    /// The image's soft tokens, `[patches, hidden]`, from its merged patches.
    pub fn encode(&self, image: VisionInput<'_>) -> Result<Tensor> {
        let n = image.positions.len();
        let values = self.cfg.patch_pixels * self.cfg.patch_pixels * 3;
        if n == 0 || image.patches.len() != n * values {
            return Err(ModelError::Input(format!(
                "an image needs {values} values per {}-pixel patch ({} values for {n} positions)",
                self.cfg.patch_pixels,
                image.patches.len()
            )));
        }
        let d = self.cfg.embed_dim;
        let table = self.cfg.position_table_size;
        if let Some(&(x, y)) = image
            .positions
            .iter()
            .find(|(x, y)| *x as usize >= table || *y as usize >= table)
        {
            return Err(ModelError::Input(format!(
                "patch position ({x}, {y}) is outside the position table ({table})"
            )));
        }
        let x = Tensor::from_slice(image.patches, (n, values), &self.device)?;
        let h = self.patch_ln1.forward(&x)?;
        let h = self
            .patch_dense
            .forward(&h)?
            .broadcast_add(&self.patch_dense_bias)?;
        let h = self.patch_ln2.forward(&h)?;
        let mut pos = Vec::with_capacity(n * d);
        for &(x, y) in image.positions {
            let xr = &self.position_table[(x as usize * 2) * d..][..d];
            let yr = &self.position_table[(y as usize * 2 + 1) * d..][..d];
            pos.extend(xr.iter().zip(yr).map(|(a, b)| a + b));
        }
        let h = (h + Tensor::from_vec(pos, (n, d), &self.device)?)?;
        let h = self.pos_norm.forward(&h)?;
        let h = RmsNorm::new(None, self.cfg.rms_norm_eps).forward(&h)?;
        self.projection.forward(&h)
    }
}
