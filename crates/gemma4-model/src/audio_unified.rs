//! The 12B's (`gemma4_unified`) encoder-free audio path, mirroring the
//! reference's `embed_audio` (`Gemma4UnifiedMultimodalEmbedder`): each
//! 640-sample frame of 16 kHz audio → RMSNorm without scale →
//! `embedding_projection` into the text width; one soft token per 40 ms.

use candle_core::{Device, Tensor};
use serde_json::Value;

use crate::error::{ConfigError, ModelError, Result};
use crate::layers::RmsNorm;
use crate::loader::Weights;
use crate::storage::Linear;
use crate::vision::MediaTokens;

/// The audio embedder: a norm and a projection of raw frames.
pub struct UnifiedAudioEmbedder {
    /// Samples per frame (`audio_embed_dim`).
    pub frame: usize,
    pub tokens: MediaTokens,
    eps: f64,
    projection: Linear,
    device: Device,
}

impl UnifiedAudioEmbedder {
    /// The checkpoint's encoder-free audio embedder, from `config.json` and
    /// a source at the multimodal root; `None` when its `audio_config` is
    /// absent or another kind (the E2B/E4B conformer tower is
    /// [`crate::audio::AudioTower`]).
    pub fn load(json: &Value, text_hidden: usize, weights: &Weights<'_>) -> Result<Option<Self>> {
        let Some(a) = json.get("audio_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        if a.get("model_type").and_then(Value::as_str) != Some("gemma4_unified_audio") {
            return Ok(None);
        }
        let frame = match a.get("audio_embed_dim") {
            None => 640,
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                ConfigError::invalid("audio_config.audio_embed_dim", "must be a whole number")
            })?,
        };
        let name = [
            "embed_audio.embedding_projection.weight",
            "embed_audio.multimodal_embedder.embedding_projection.weight",
        ]
        .into_iter()
        .find(|n| weights.contains(n))
        .unwrap_or("embed_audio.embedding_projection.weight");
        Ok(Some(Self {
            frame,
            tokens: MediaTokens::audio(json),
            eps: a
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            projection: weights.linear(name, text_hidden, frame)?,
            device: Device::Cpu,
        }))
    }

    /// The clip's soft tokens, `[frames, hidden]`, from `[frames, frame]` samples.
    pub fn encode(&self, frames: &[f32]) -> Result<Tensor> {
        if frames.is_empty() || !frames.len().is_multiple_of(self.frame) {
            return Err(ModelError::Input(format!(
                "audio frames need {} samples each ({} samples given)",
                self.frame,
                frames.len()
            )));
        }
        let x = Tensor::from_slice(
            frames,
            (frames.len() / self.frame, self.frame),
            &self.device,
        )?;
        let x = RmsNorm::new(None, self.eps).forward(&x)?;
        self.projection.forward(&x)
    }
}
