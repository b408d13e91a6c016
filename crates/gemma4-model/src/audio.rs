//! Gemma 4's audio encoder (E2B/E4B), mirroring the reference
//! (`Gemma4AudioModel` and `Gemma4MultimodalEmbedder`) step by step:
//!
//! log-mel features `[frames, 128]` → two 3×3 stride-2 convolutions over
//! (time, frequency), each with a LayerNorm over channels and ReLU → a linear
//! projection of each time step's (frequency, channel) grid → conformer
//! layers → `output_proj` → RMSNorm without scale → `embedding_projection`
//! into the text model's width. One soft token per 40 ms.
//!
//! A conformer layer: half-step feed-forward; chunked local self-attention
//! (each position sees itself and the 11 before it, Transformer-XL relative
//! position terms, a per-dimension query scale, logits soft-capped at 50);
//! a light convolution (GLU, causal depthwise kernel of 5, RMSNorm, SiLU);
//! a second half-step feed-forward; a final RMSNorm. Linears are clipped to
//! the stored ranges where the checkpoint has them.
//!
//! The reference pads the clip and masks the padding out of every stage (the
//! convolutions see zeros there, the attention never reads it, the depthwise
//! convolution is causal); here only the real frames are computed, which is
//! the same arithmetic on the rows that are kept.

use std::path::Path;

use candle_core::{Device, Tensor, D};
use serde_json::Value;

use crate::audio_unified::UnifiedAudioEmbedder;
use crate::error::{ConfigError, ModelError, Result};
use crate::layers::RmsNorm;
use crate::loader::{LoadReport, Weights};
use crate::storage::Linear;
use crate::vision::{from_dir, from_mmproj, ClippedLinear, MediaTokens};

/// Mel bins the feature extractor writes per frame.
pub const MEL_BINS: usize = 128;

/// The audio tower's settings (`audio_config` of `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct AudioConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    /// Channels of the two subsampling convolutions.
    pub conv_channels: [usize; 2],
    pub conv_kernel_size: usize,
    pub residual_weight: f64,
    pub chunk_size: usize,
    pub context_left: usize,
    pub context_right: usize,
    pub logit_cap: f64,
    pub invalid_logit: f32,
    pub clipped_linears: bool,
    pub rms_norm_eps: f64,
    pub gradient_clipping: f64,
    pub output_dims: usize,
    pub tokens: MediaTokens,
}

impl AudioConfig {
    /// The conformer tower's settings; `None` without an `audio_config` or
    /// with the 12B's encoder-free one.
    pub fn from_hf_json(json: &Value) -> std::result::Result<Option<Self>, ConfigError> {
        let Some(a) = json.get("audio_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        if a.get("model_type").and_then(Value::as_str) == Some("gemma4_unified_audio") {
            return Ok(None);
        }
        let key = |k: &str| format!("audio_config.{k}");
        let usize_of = |k: &str, default: usize| -> std::result::Result<usize, ConfigError> {
            match a.get(k) {
                None => Ok(default),
                Some(x) => x
                    .as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| ConfigError::invalid(key(k), "must be a whole number")),
            }
        };
        let f64_of = |k: &str, default: f64| -> std::result::Result<f64, ConfigError> {
            match a.get(k) {
                None => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| ConfigError::invalid(key(k), "must be a number")),
            }
        };
        let activation = a
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if activation != "silu" {
            return Err(ConfigError::invalid(
                key("hidden_act"),
                format!("`{activation}` is not supported (only silu)"),
            ));
        }
        let conv_channels = match a.get("subsampling_conv_channels") {
            None => [128, 32],
            Some(v) => match v
                .as_array()
                .map(|c| c.iter().map(Value::as_u64).collect::<Vec<_>>())
            {
                Some(c) if c.len() == 2 && c.iter().all(Option::is_some) => {
                    [c[0].unwrap_or(0) as usize, c[1].unwrap_or(0) as usize]
                }
                _ => {
                    return Err(ConfigError::invalid(
                        key("subsampling_conv_channels"),
                        "must be two whole numbers",
                    ))
                }
            },
        };
        let cfg = Self {
            hidden_size: usize_of("hidden_size", 1024)?,
            num_layers: usize_of("num_hidden_layers", 12)?,
            num_heads: usize_of("num_attention_heads", 8)?,
            conv_channels,
            conv_kernel_size: usize_of("conv_kernel_size", 5)?,
            residual_weight: f64_of("residual_weight", 0.5)?,
            chunk_size: usize_of("attention_chunk_size", 12)?,
            context_left: usize_of("attention_context_left", 13)?,
            context_right: usize_of("attention_context_right", 0)?,
            logit_cap: f64_of("attention_logit_cap", 50.0)?,
            invalid_logit: f64_of("attention_invalid_logits_value", -1e9)? as f32,
            clipped_linears: a
                .get("use_clipped_linears")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            rms_norm_eps: f64_of("rms_norm_eps", 1e-6)?,
            gradient_clipping: f64_of("gradient_clipping", 1e10)?,
            output_dims: usize_of("output_proj_dims", 1536)?,
            tokens: MediaTokens::audio(json),
        };
        if cfg.num_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_heads) {
            return Err(ConfigError::invalid(
                key("num_attention_heads"),
                "must divide hidden_size",
            ));
        }
        // The reference's projection after the convolutions is sized from the
        // first convolution's channels; it matches the 128 mel bins halved
        // twice only when those are 128.
        if cfg.conv_channels[0] != MEL_BINS || cfg.conv_channels[1] == 0 {
            return Err(ConfigError::invalid(
                key("subsampling_conv_channels"),
                format!("the first must be {MEL_BINS} (the mel bins) and the second above 0"),
            ));
        }
        if cfg.chunk_size == 0 || cfg.context_left == 0 || cfg.logit_cap <= 0.0 {
            return Err(ConfigError::invalid(
                key("attention_chunk_size"),
                "the chunk, the left context and the logit cap must be above 0",
            ));
        }
        // The relative shift reads zeros (not a wrapped row) for keys before a
        // chunk's start only when the context is wide enough.
        if cfg.context() + 1 < cfg.chunk_size + cfg.positions() {
            return Err(ConfigError::invalid(
                key("attention_context_left"),
                "a context this narrow beside the chunk is not supported",
            ));
        }
        Ok(Some(cfg))
    }

    /// Keys a chunk of queries reads: the chunk and both horizons.
    fn context(&self) -> usize {
        self.chunk_size + self.max_past() + self.context_right
    }

    fn max_past(&self) -> usize {
        self.context_left - 1
    }

    /// Relative positions with a learned key: `context / 2 + 1`.
    fn positions(&self) -> usize {
        self.context() / 2 + 1
    }
}

/// What turns audio into soft tokens: the E2B/E4B conformer tower, or the
/// 12B's encoder-free frame embedder.
pub enum AudioEncoder {
    Tower(Box<AudioTower>),
    Unified(UnifiedAudioEmbedder),
}

/// What an [`AudioEncoder`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFeatures {
    /// `[frames, 128]` log-mel features.
    LogMel,
    /// Raw 16 kHz samples cut into frames of this many.
    Frames(usize),
}

impl AudioFeatures {
    /// The soft tokens an encoder gives for `values` feature values: the
    /// tower's two stride-2 subsampling convolutions each halve the mel
    /// frames (rounding up); the frame embedder gives one per frame.
    pub fn soft_tokens(self, values: usize) -> usize {
        match self {
            Self::LogMel => (values / MEL_BINS).div_ceil(2).div_ceil(2),
            Self::Frames(n) => values / n.max(1),
        }
    }
}

impl AudioEncoder {
    /// The checkpoint's audio encoder, loaded as stored; `None` when its
    /// `config.json` has no `audio_config`.
    pub fn load_dir(dir: &Path, text_hidden: usize) -> Result<Option<Self>> {
        Ok(Self::load_dir_measured(dir, text_hidden)?.map(|(e, _)| e))
    }

    /// [`Self::load_dir`], with what the load kept resident.
    pub fn load_dir_measured(dir: &Path, text_hidden: usize) -> Result<Option<(Self, LoadReport)>> {
        from_dir(dir, "audio_config", text_hidden, Self::load_from)
    }

    /// The audio tower of a llama.cpp multimodal projector file; the media
    /// token ids come from `text_config` (`{}` for Gemma 4's own).
    pub fn load_mmproj(
        path: &Path,
        text_hidden: usize,
        text_config: &Value,
    ) -> Result<Option<(Self, LoadReport)>> {
        from_mmproj(
            path,
            "audio_config",
            (text_hidden, text_config),
            Self::load_from,
        )
    }

    /// The encoder `json` (a `config.json`) describes, from tower tensors
    /// named below the multimodal root.
    fn load_from(
        json: &Value,
        src: &dyn crate::WeightSource,
        text_hidden: usize,
    ) -> Result<Option<(Self, LoadReport)>> {
        let weights = Weights::new(src, crate::LoadPolicy::default());
        let encoder = match UnifiedAudioEmbedder::load(json, text_hidden, &weights)? {
            Some(unified) => Self::Unified(unified),
            None => match AudioConfig::from_hf_json(json)? {
                Some(cfg) => Self::Tower(Box::new(AudioTower::load(cfg, text_hidden, &weights)?)),
                None => return Ok(None),
            },
        };
        Ok(Some((encoder, weights.report())))
    }

    pub fn tokens(&self) -> MediaTokens {
        match self {
            Self::Tower(t) => t.cfg.tokens,
            Self::Unified(u) => u.tokens,
        }
    }

    pub fn features(&self) -> AudioFeatures {
        match self {
            Self::Tower(_) => AudioFeatures::LogMel,
            Self::Unified(u) => AudioFeatures::Frames(u.frame),
        }
    }

    /// The clip's soft tokens, `[tokens, hidden]`, from the features
    /// [`Self::features`] names (`[rows, row width]`, row-major).
    pub fn encode(&self, features: &[f32]) -> Result<Tensor> {
        match self {
            Self::Tower(t) => t.encode(features),
            Self::Unified(u) => u.encode(features),
        }
    }

    /// A line for the load log.
    pub fn describe(&self) -> String {
        match self {
            Self::Tower(t) => format!(
                "audio tower: {} conformer layers, {} wide",
                t.cfg.num_layers, t.cfg.hidden_size
            ),
            Self::Unified(u) => format!("encoder-free audio embedder: {}-sample frames", u.frame),
        }
    }
}

/// A 3×3, stride-2, padding-1 convolution over (time, frequency), then a
/// LayerNorm over its channels (scale, no bias) and ReLU.
struct SubsampleLayer {
    /// `[out, in · 9]`, the stored `[out, in, 3, 3]` flattened.
    weight: Tensor,
    norm: Vec<f32>,
    channels: usize,
}

struct FeedForward {
    pre_norm: RmsNorm,
    up: ClippedLinear,
    down: ClippedLinear,
    post_norm: RmsNorm,
}

struct Attention {
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    post: ClippedLinear,
    /// Per head dimension: `head_dim^-½ / ln 2 · softplus(per_dim_scale)`.
    q_scale: Vec<f32>,
    /// `[positions, heads · head_dim]`: the relative keys, row `p` for the
    /// sinusoid of position `positions − 1 − p`.
    relative_keys: Vec<f32>,
}

struct LightConv {
    pre_norm: RmsNorm,
    start: ClippedLinear,
    /// `[hidden, kernel]`.
    depthwise: Vec<f32>,
    conv_norm: RmsNorm,
    end: ClippedLinear,
}

struct ConformerLayer {
    ffw_start: FeedForward,
    norm_pre_attn: RmsNorm,
    attention: Attention,
    norm_post_attn: RmsNorm,
    lconv: LightConv,
    ffw_end: FeedForward,
    norm_out: RmsNorm,
}

/// The conformer tower and its projection into the text model.
pub struct AudioTower {
    cfg: AudioConfig,
    subsample: [SubsampleLayer; 2],
    input_proj: Linear,
    layers: Vec<ConformerLayer>,
    output_proj: Linear,
    output_bias: Tensor,
    projection: Linear,
    device: Device,
}

impl AudioTower {
    /// Loads the tower from `audio_tower.*` and `embed_audio.*` of a source
    /// positioned at the multimodal model's root (`model.`).
    pub fn load(cfg: AudioConfig, text_hidden: usize, src: &Weights<'_>) -> Result<Self> {
        let h = cfg.hidden_size;
        let p = "audio_tower.";
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                Some(src.vector(name, &[h])?),
                cfg.rms_norm_eps,
            ))
        };
        // The feed-forward's and the layer's own norms use the default epsilon.
        let norm_default_eps = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::new(Some(src.vector(name, &[h])?), 1e-6))
        };
        let clipped = |name: &str, out: usize, inp: usize| {
            ClippedLinear::load(src, name, out, inp, cfg.clipped_linears)
        };
        let subsample_layer = |i: usize, inp: usize, out: usize| -> Result<SubsampleLayer> {
            let l = format!("{p}subsample_conv_projection.layer{i}.");
            Ok(SubsampleLayer {
                weight: src
                    .vector(&format!("{l}conv.weight"), &[out, inp, 3, 3])?
                    .reshape((out, inp * 9))?,
                norm: src
                    .vector(&format!("{l}norm.weight"), &[out])?
                    .to_vec1::<f32>()?,
                channels: out,
            })
        };
        let [c0, c1] = cfg.conv_channels;
        let subsample = [subsample_layer(0, 1, c0)?, subsample_layer(1, c0, c1)?];
        let input_proj = src.linear(
            &format!("{p}subsample_conv_projection.input_proj_linear.weight"),
            h,
            MEL_BINS / 4 * c1,
        )?;
        let hd = h / cfg.num_heads;
        let sinusoids = relative_sinusoids(cfg.positions(), h);
        let ffw = |l: &str| -> Result<FeedForward> {
            Ok(FeedForward {
                pre_norm: norm_default_eps(&format!("{l}pre_layer_norm.weight"))?,
                up: clipped(&format!("{l}ffw_layer_1"), 4 * h, h)?,
                down: clipped(&format!("{l}ffw_layer_2"), h, 4 * h)?,
                post_norm: norm_default_eps(&format!("{l}post_layer_norm.weight"))?,
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let l = format!("{p}layers.{i}.");
            let a = format!("{l}self_attn.");
            let per_dim = src
                .vector(&format!("{a}per_dim_scale"), &[hd])?
                .to_vec1::<f32>()?;
            let base = (hd as f32).powf(-0.5) / std::f32::consts::LN_2;
            let relative = src.linear(&format!("{a}relative_k_proj.weight"), h, h)?;
            let relative_keys = relative
                .forward(&Tensor::from_slice(
                    &sinusoids,
                    (cfg.positions(), h),
                    &Device::Cpu,
                )?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let c = format!("{l}lconv1d.");
            let k = cfg.conv_kernel_size;
            layers.push(ConformerLayer {
                ffw_start: ffw(&format!("{l}feed_forward1."))?,
                norm_pre_attn: norm_default_eps(&format!("{l}norm_pre_attn.weight"))?,
                attention: Attention {
                    q: clipped(&format!("{a}q_proj"), h, h)?,
                    k: clipped(&format!("{a}k_proj"), h, h)?,
                    v: clipped(&format!("{a}v_proj"), h, h)?,
                    post: clipped(&format!("{a}post"), h, h)?,
                    q_scale: per_dim.iter().map(|&s| base * softplus(s)).collect(),
                    relative_keys,
                },
                norm_post_attn: norm_default_eps(&format!("{l}norm_post_attn.weight"))?,
                lconv: LightConv {
                    pre_norm: norm(&format!("{c}pre_layer_norm.weight"))?,
                    start: clipped(&format!("{c}linear_start"), 2 * h, h)?,
                    depthwise: src
                        .vector(&format!("{c}depthwise_conv1d.weight"), &[h, 1, k])?
                        .flatten_all()?
                        .to_vec1::<f32>()?,
                    conv_norm: norm(&format!("{c}conv_norm.weight"))?,
                    end: clipped(&format!("{c}linear_end"), h, h)?,
                },
                ffw_end: ffw(&format!("{l}feed_forward2."))?,
                norm_out: norm_default_eps(&format!("{l}norm_out.weight"))?,
            });
        }
        let output_proj = src.linear(&format!("{p}output_proj.weight"), cfg.output_dims, h)?;
        let output_bias = src.vector(&format!("{p}output_proj.bias"), &[cfg.output_dims])?;
        let projection = src.linear(
            "embed_audio.embedding_projection.weight",
            text_hidden,
            cfg.output_dims,
        )?;
        Ok(Self {
            cfg,
            subsample,
            input_proj,
            layers,
            output_proj,
            output_bias,
            projection,
            device: Device::Cpu,
        })
    }

    pub fn config(&self) -> &AudioConfig {
        &self.cfg
    }

    /// The clip's soft tokens in the text model's space, `[tokens, hidden]`,
    /// from `[frames, 128]` log-mel features.
    pub fn encode(&self, mel: &[f32]) -> Result<Tensor> {
        if mel.is_empty() || !mel.len().is_multiple_of(MEL_BINS) {
            return Err(ModelError::Input(format!(
                "log-mel features come in rows of {MEL_BINS} ({} values given)",
                mel.len()
            )));
        }
        let frames = mel.len() / MEL_BINS;
        let eps = self.cfg.rms_norm_eps as f32;
        let (x, t, f) = self.subsample[0].forward(mel, frames, MEL_BINS, 1, eps, &self.device)?;
        let c0 = self.subsample[0].channels;
        let (x, t, f) = self.subsample[1].forward(&x, t, f, c0, eps, &self.device)?;
        let x = Tensor::from_vec(x, (t, f * self.subsample[1].channels), &self.device)?;
        let mut h = self.input_proj.forward(&x)?;
        for layer in &self.layers {
            h = self.layer(layer, &h)?;
        }
        let h = self
            .output_proj
            .forward(&h)?
            .broadcast_add(&self.output_bias)?;
        let h = RmsNorm::new(None, self.cfg.rms_norm_eps).forward(&h)?;
        self.projection.forward(&h)
    }

    fn clip(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.cfg.gradient_clipping.min(f64::from(f32::MAX)) as f32;
        Ok(x.clamp(-c, c)?)
    }

    fn layer(&self, l: &ConformerLayer, x: &Tensor) -> Result<Tensor> {
        let h = self.feed_forward(&l.ffw_start, x)?;
        let a = self.attention(&l.attention, &l.norm_pre_attn.forward(&self.clip(&h)?)?)?;
        let h = (l.norm_post_attn.forward(&self.clip(&a)?)? + h)?;
        let h = self.light_conv(&l.lconv, &h)?;
        let h = self.feed_forward(&l.ffw_end, &h)?;
        l.norm_out.forward(&self.clip(&h)?)
    }

    fn feed_forward(&self, f: &FeedForward, x: &Tensor) -> Result<Tensor> {
        let h = f.pre_norm.forward(&self.clip(x)?)?;
        let h = f.down.forward(&f.up.forward(&h)?.silu()?)?;
        let h = f.post_norm.forward(&self.clip(&h)?)?;
        Ok(((h * self.cfg.residual_weight)? + x)?)
    }

    /// Chunked local attention: position `t` reads keys `t − (left − 2)` …
    /// `t + right − 1`, with the relative term for the distances the
    /// reference's shifted product gives (none for future keys).
    fn attention(&self, a: &Attention, x: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let t = x.dim(0)?;
        let h = cfg.hidden_size;
        let heads = cfg.num_heads;
        let hd = h / heads;
        let q = a.q.forward(x)?.flatten_all()?.to_vec1::<f32>()?;
        let k = a.k.forward(x)?.flatten_all()?.to_vec1::<f32>()?;
        let v = a.v.forward(x)?.flatten_all()?.to_vec1::<f32>()?;
        let k_scale = ((1.0 + std::f64::consts::E).ln() / std::f64::consts::LN_2) as f32;
        let (past, right, positions) = (cfg.max_past(), cfg.context_right, cfg.positions());
        let cap = cfg.logit_cap as f32;
        let mut out = vec![0f32; t * h];
        let mut scores = Vec::with_capacity(past + right);
        let mut query = vec![0f32; hd];
        for i in 0..t {
            let first = i.saturating_sub(past - 1);
            // With no right context a position still sees itself.
            let last = (i + right.max(1)).min(t);
            for head in 0..heads {
                let off = head * hd;
                for (d, qv) in query.iter_mut().enumerate() {
                    *qv = q[i * h + off + d] * a.q_scale[d];
                }
                scores.clear();
                for j in first..last {
                    let key = &k[j * h + off..][..hd];
                    let mut s: f32 = query.iter().zip(key).map(|(q, k)| q * (k * k_scale)).sum();
                    // Column `p` of the shifted relative product.
                    let p = j + past - i;
                    if p < positions {
                        let rel = &a.relative_keys[p * h + off..][..hd];
                        s += query.iter().zip(rel).map(|(q, r)| q * r).sum::<f32>();
                    }
                    scores.push((s / cap).tanh() * cap);
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let dst = &mut out[i * h + off..][..hd];
                for (w, j) in scores.iter().zip(first..last) {
                    let w = w / sum;
                    for (o, val) in dst.iter_mut().zip(&v[j * h + off..][..hd]) {
                        *o += w * val;
                    }
                }
            }
        }
        a.post
            .forward(&Tensor::from_vec(out, (t, h), &self.device)?)
    }

    fn light_conv(&self, c: &LightConv, x: &Tensor) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        let y = c.start.forward(&c.pre_norm.forward(x)?)?;
        let gated = (y.narrow(D::Minus1, 0, h)? * sigmoid(&y.narrow(D::Minus1, h, h)?)?)?;
        let g = gated.flatten_all()?.to_vec1::<f32>()?;
        let t = g.len() / h;
        let k = self.cfg.conv_kernel_size;
        let mut conv = vec![0f32; t * h];
        for i in 0..t {
            for j in 0..k {
                // Tap `j` reads `k − 1 − j` steps back (zeros before the start).
                let Some(src) = (i + j).checked_sub(k - 1) else {
                    continue;
                };
                for ch in 0..h {
                    conv[i * h + ch] += c.depthwise[ch * k + j] * g[src * h + ch];
                }
            }
        }
        let conv = Tensor::from_vec(conv, (t, h), &self.device)?;
        let y = c.conv_norm.forward(&self.clip(&conv)?)?.silu()?;
        Ok((c.end.forward(&y)? + x)?)
    }
}

impl SubsampleLayer {
    /// `x`: `[time, freq, in_channels]` → (`[time', freq', channels]`,
    /// time', freq'), each halved, rounding up.
    fn forward(
        &self,
        x: &[f32],
        time: usize,
        freq: usize,
        in_channels: usize,
        eps: f32,
        device: &Device,
    ) -> Result<(Vec<f32>, usize, usize)> {
        let (t_out, f_out) = (time.div_ceil(2), freq.div_ceil(2));
        // Rows (t, f), columns (in channel, dt, df), as the stored weight's.
        let width = in_channels * 9;
        let mut cols = vec![0f32; t_out * f_out * width];
        for t in 0..t_out {
            for f in 0..f_out {
                let row = &mut cols[(t * f_out + f) * width..][..width];
                for dt in 0..3 {
                    let Some(ti) = (2 * t + dt).checked_sub(1).filter(|&v| v < time) else {
                        continue;
                    };
                    for df in 0..3 {
                        let Some(fi) = (2 * f + df).checked_sub(1).filter(|&v| v < freq) else {
                            continue;
                        };
                        let src = &x[(ti * freq + fi) * in_channels..][..in_channels];
                        for (c, v) in src.iter().enumerate() {
                            row[c * 9 + dt * 3 + df] = *v;
                        }
                    }
                }
            }
        }
        let cols = Tensor::from_vec(cols, (t_out * f_out, width), device)?;
        let mut y = cols
            .matmul(&self.weight.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let n = self.channels;
        for row in y.chunks_exact_mut(n) {
            let mean = row.iter().sum::<f32>() / n as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for (v, w) in row.iter_mut().zip(&self.norm) {
                *v = ((*v - mean) * inv * w).max(0.0);
            }
        }
        Ok((y, t_out, f_out))
    }
}

fn softplus(x: f32) -> f32 {
    // PyTorch's threshold: linear above 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

/// `[positions, hidden]`: row `p` is `[sin(s·τ_i)…, cos(s·τ_i)…]` for
/// `s = positions − 1 − p`, `τ_i = 10000^(−i / (hidden/2 − 1))`.
fn relative_sinusoids(positions: usize, hidden: usize) -> Vec<f32> {
    let half = hidden / 2;
    let step = (10_000f64).ln() / (half.max(2) - 1) as f64;
    let inv: Vec<f32> = (0..half)
        .map(|i| (-(i as f64) * step).exp() as f32)
        .collect();
    let mut out = Vec::with_capacity(positions * hidden);
    for p in 0..positions {
        let s = (positions - 1 - p) as f32;
        out.extend(inv.iter().map(|&f| (s * f).sin()));
        out.extend(inv.iter().map(|&f| (s * f).cos()));
    }
    out
}
