//! Gemma 4's vision encoder, mirroring the reference (`Gemma4VisionModel`
//! and `Gemma4MultimodalEmbedder`) step by step:
//!
//! patches `p ∈ [0, 1]` → `input_proj(2·(p − ½))` + the x and y rows of the
//! position table → encoder layers (RMSNorm; attention over every patch of
//! the image, with q/k norms, a scale-less v norm and 2-D RoPE: the first half
//! of each head rotated by the patch's x, the second by its y; gated-GELU MLP;
//! norms after each branch; clipped linears where the checkpoint has them) →
//! average of each 3×3 block of patches → × √D → standardisation → RMSNorm
//! without scale → `embedding_projection` into the text model's width.
//!
//! The reference pads every image to its patch budget and masks the padding;
//! here only the real patches are computed, which is the same arithmetic on
//! the rows that matter.

use std::path::Path;

use candle_core::{Device, Tensor, D};
use serde_json::Value;

use crate::error::{ConfigError, ModelError, Result};
use crate::layers::{gated_gelu, softmax_last_dim, RmsNorm};
use crate::loader::{LoadReport, Weights};
use crate::storage::Linear;

/// The vision tower's settings (`vision_config` of `config.json`) and the
/// image token ids of the multimodal wrapper.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub patch_size: usize,
    pub pooling: usize,
    pub position_table_size: usize,
    pub rope_theta: f64,
    pub clipped_linears: bool,
    pub standardize: bool,
    pub tokens: MediaTokens,
    /// A video frame's soft-token placeholder (`video_token_id`); a frame sits
    /// between the image's begin and end ids.
    pub video_soft: u32,
}

/// Gemma 4's `<|video|>` id.
const DEFAULT_VIDEO_TOKEN: u32 = 258_884;

/// The token ids of one media item in the prompt: `begin`, one `soft`
/// placeholder per soft token, `end` (`<|image>`, `<|image|>`, `<image|>`
/// for images; `<|audio>`, `<|audio|>`, `<audio|>` for audio).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaTokens {
    pub soft: u32,
    pub begin: u32,
    pub end: u32,
}

impl MediaTokens {
    /// An image's ids from the multimodal config (`image_token_id`,
    /// `boi_token_id`, `eoi_token_id`; Gemma 4's ids where absent).
    pub fn image(json: &Value) -> Self {
        Self::read(
            json,
            &["image_token_id"],
            &["boi_token_id"],
            &["eoi_token_id"],
            (258_880, 255_999, 258_882),
        )
    }

    /// A video frame's ids: `video_token_id` between the image's begin and end.
    pub fn video(json: &Value) -> Self {
        Self::read(
            json,
            &["video_token_id"],
            &["boi_token_id"],
            &["eoi_token_id"],
            (DEFAULT_VIDEO_TOKEN, 255_999, 258_882),
        )
    }

    /// An audio clip's ids (`audio_token_id`, `boa_token_id`, and the end as
    /// the published configs spell it, `eoa_token_index`).
    pub fn audio(json: &Value) -> Self {
        Self::read(
            json,
            &["audio_token_id"],
            &["boa_token_id"],
            &["eoa_token_index", "eoa_token_id"],
            (258_881, 256_000, 258_883),
        )
    }

    fn read(
        json: &Value,
        soft: &[&str],
        begin: &[&str],
        end: &[&str],
        defaults: (u32, u32, u32),
    ) -> Self {
        let token = |keys: &[&str], default: u32| {
            keys.iter()
                .find_map(|k| json.get(*k).and_then(Value::as_u64))
                .map_or(default, |x| x as u32)
        };
        Self {
            soft: token(soft, defaults.0),
            begin: token(begin, defaults.1),
            end: token(end, defaults.2),
        }
    }
}

/// Reads a checkpoint directory's `config.json`.
pub fn read_config(dir: &Path) -> Result<Value> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    Ok(serde_json::from_str(&text).map_err(|e| ConfigError::Json {
        path: path.display().to_string(),
        message: e.to_string(),
    })?)
}

/// Loads an encoder of `load`'s kind from the tower tensors of a checkpoint
/// directory; `None` when its `config.json` has no `key` section.
pub(crate) fn from_dir<T>(
    dir: &Path,
    key: &str,
    text_hidden: usize,
    load: impl Fn(&Value, &dyn crate::WeightSource, usize) -> Result<Option<(T, LoadReport)>>,
) -> Result<Option<(T, LoadReport)>> {
    let json = read_config(dir)?;
    if json.get(key).is_none_or(Value::is_null) {
        return Ok(None);
    }
    let src = crate::HfSafetensors::open(dir)?;
    load(&json, &src.towers(), text_hidden)
}

/// [`from_dir`] for a multimodal projector file, its configuration made
/// from the file and the media token ids of `text_config`.
pub(crate) fn from_mmproj<T>(
    path: &Path,
    key: &str,
    (text_hidden, text_config): (usize, &Value),
    load: impl Fn(&Value, &dyn crate::WeightSource, usize) -> Result<Option<(T, LoadReport)>>,
) -> Result<Option<(T, LoadReport)>> {
    let src = crate::mmproj::MmprojSource::open(path)?;
    let json = src.config_json(text_config)?;
    if json.get(key).is_none_or(Value::is_null) {
        return Ok(None);
    }
    load(&json, &src, text_hidden)
}

/// What turns an image into soft tokens: the vision tower (E2B/E4B, 31B,
/// 26B-A4B), or the 12B's encoder-free embedder.
pub enum ImageEncoder {
    Tower(VisionTower),
    Unified(crate::vision_unified::UnifiedVisionEmbedder),
}

impl ImageEncoder {
    /// The checkpoint's image encoder, loaded as stored; `None` when its
    /// `config.json` has no `vision_config`.
    pub fn load_dir(dir: &Path, text_hidden: usize) -> Result<Option<Self>> {
        Ok(Self::load_dir_measured(dir, text_hidden)?.map(|(e, _)| e))
    }

    /// [`Self::load_dir`], with what the load kept resident.
    pub fn load_dir_measured(dir: &Path, text_hidden: usize) -> Result<Option<(Self, LoadReport)>> {
        from_dir(dir, "vision_config", text_hidden, Self::load_from)
    }

    /// The vision tower of a llama.cpp multimodal projector file; the media
    /// token ids come from `text_config` (`{}` for Gemma 4's own).
    pub fn load_mmproj(
        path: &Path,
        text_hidden: usize,
        text_config: &Value,
    ) -> Result<Option<(Self, LoadReport)>> {
        from_mmproj(
            path,
            "vision_config",
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
        let Some(v) = json.get("vision_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let weights = Weights::new(src, crate::LoadPolicy::default());
        let unified = v.get("model_type").and_then(Value::as_str) == Some("gemma4_unified_vision");
        let encoder = if unified {
            let cfg = crate::vision_unified::UnifiedVisionConfig::from_hf_json(
                v,
                MediaTokens::image(json),
                MediaTokens::video(json).soft,
            )?;
            Self::Unified(crate::vision_unified::UnifiedVisionEmbedder::load(
                cfg,
                text_hidden,
                &weights,
            )?)
        } else {
            let cfg = VisionConfig::from_hf_json(json)?
                .ok_or_else(|| ConfigError::missing("vision_config"))?;
            Self::Tower(VisionTower::load(cfg, text_hidden, &weights)?)
        };
        Ok(Some((encoder, weights.report())))
    }

    pub fn tokens(&self) -> MediaTokens {
        match self {
            Self::Tower(t) => t.config().tokens,
            Self::Unified(u) => u.config().tokens,
        }
    }

    /// A video frame's ids: the image's begin and end around `<|video|>`
    /// placeholders (frames are encoded as images are).
    pub fn video_tokens(&self) -> MediaTokens {
        let soft = match self {
            Self::Tower(t) => t.config().video_soft,
            Self::Unified(u) => u.config().video_soft,
        };
        MediaTokens {
            soft,
            ..self.tokens()
        }
    }

    /// Whether the encoder takes merged patches (`pooling × pooling` blocks
    /// as one patch), one soft token each, rather than patches it pools.
    pub fn takes_merged_patches(&self) -> bool {
        matches!(self, Self::Unified(_))
    }

    /// `(patch_size, pooling_kernel_size)` of the checkpoint: the image
    /// processor resizes on blocks of their product.
    pub fn patch_geometry(&self) -> (usize, usize) {
        match self {
            Self::Tower(t) => (t.config().patch_size, t.config().pooling),
            Self::Unified(u) => (u.config().patch_size, u.config().pooling),
        }
    }

    /// Entries of the position table: every patch position (in the units
    /// the encoder reads) must be below it on both axes.
    pub fn position_table(&self) -> usize {
        match self {
            Self::Tower(t) => t.config().position_table_size,
            Self::Unified(u) => u.config().position_table_size,
        }
    }

    /// The image's soft tokens, `[tokens, hidden]`.
    pub fn encode(&self, image: VisionInput<'_>) -> Result<Tensor> {
        match self {
            Self::Tower(t) => t.encode(image),
            Self::Unified(u) => u.encode(image),
        }
    }

    /// A line for the load log.
    pub fn describe(&self) -> String {
        match self {
            Self::Tower(t) => format!(
                "vision tower: {} layers, {} wide",
                t.config().num_layers,
                t.config().hidden_size
            ),
            Self::Unified(u) => format!(
                "encoder-free image embedder: {}-pixel patches, {} wide",
                u.config().patch_pixels,
                u.config().embed_dim
            ),
        }
    }
}

impl VisionConfig {
    pub fn from_hf_json(json: &Value) -> std::result::Result<Option<Self>, ConfigError> {
        let Some(v) = json.get("vision_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let usize_of = |key: &str,
                        default: Option<usize>|
         -> std::result::Result<usize, ConfigError> {
            match v.get(key) {
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    ConfigError::invalid(format!("vision_config.{key}"), "must be a whole number")
                }),
                None => default.ok_or_else(|| ConfigError::missing(format!("vision_config.{key}"))),
            }
        };
        if v.get("model_type").and_then(Value::as_str) == Some("gemma4_unified_vision") {
            // The 12B's encoder-free embedder (see `ImageEncoder::load_dir`).
            return Ok(None);
        }
        let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);
        let activation = v
            .get("hidden_activation")
            .and_then(Value::as_str)
            .unwrap_or("gelu_pytorch_tanh");
        if activation != "gelu_pytorch_tanh" {
            return Err(ConfigError::invalid(
                "vision_config.hidden_activation",
                format!("`{activation}` is not supported (only gelu_pytorch_tanh)"),
            ));
        }
        let rope = v.get("rope_parameters");
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
        {
            if kind != "axial" {
                return Err(ConfigError::invalid(
                    "vision_config.rope_parameters.rope_type",
                    format!("`{kind}` is not supported (only axial)"),
                ));
            }
        }
        let hidden_size = usize_of("hidden_size", Some(768))?;
        let num_heads = usize_of("num_attention_heads", Some(12))?;
        let cfg = Self {
            hidden_size,
            intermediate_size: usize_of("intermediate_size", Some(3072))?,
            num_layers: usize_of("num_hidden_layers", Some(16))?,
            num_heads,
            num_kv_heads: usize_of("num_key_value_heads", Some(num_heads))?,
            head_dim: usize_of("head_dim", Some(64))?,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            patch_size: at_least_one(usize_of("patch_size", Some(16))?, "patch_size")?,
            pooling: at_least_one(
                usize_of("pooling_kernel_size", Some(3))?,
                "pooling_kernel_size",
            )?,
            position_table_size: usize_of("position_embedding_size", Some(10240))?,
            rope_theta: rope
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(100.0),
            clipped_linears: flag("use_clipped_linears"),
            standardize: flag("standardize"),
            tokens: MediaTokens::image(json),
            video_soft: MediaTokens::video(json).soft,
        };
        if !cfg.head_dim.is_multiple_of(4)
            || cfg.num_kv_heads == 0
            || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads)
        {
            return Err(ConfigError::invalid(
                "vision_config.head_dim",
                "needs a multiple of 4 and whole query groups per KV head",
            ));
        }
        Ok(Some(cfg))
    }
}

/// `vision_config.KEY`'s value, refused at load when it is 0 (no patch can
/// be cut, nothing pooled).
pub(crate) fn at_least_one(value: usize, key: &str) -> std::result::Result<usize, ConfigError> {
    if value == 0 {
        return Err(ConfigError::invalid(
            format!("vision_config.{key}"),
            "must be at least 1",
        ));
    }
    Ok(value)
}

/// One image as the encoder takes it: `[patches, patch² · 3]` values in
/// `[0, 1]` and each patch's `(x, y)`.
#[derive(Debug, Clone, Copy)]
pub struct VisionInput<'a> {
    pub patches: &'a [f32],
    pub positions: &'a [(u32, u32)],
}

/// A linear layer whose input and output may be clamped to stored ranges.
pub(crate) struct ClippedLinear {
    linear: Linear,
    input: Option<(f32, f32)>,
    output: Option<(f32, f32)>,
}

impl ClippedLinear {
    pub(crate) fn load(
        src: &Weights<'_>,
        name: &str,
        out: usize,
        inp: usize,
        clipped: bool,
    ) -> Result<Self> {
        let linear = src.linear(&format!("{name}.linear.weight"), out, inp)?;
        let range = |lo: &str, hi: &str| -> Result<Option<(f32, f32)>> {
            if !clipped {
                return Ok(None);
            }
            let lo = src
                .vector(&format!("{name}.{lo}"), &[])?
                .to_scalar::<f32>()?;
            let hi = src
                .vector(&format!("{name}.{hi}"), &[])?
                .to_scalar::<f32>()?;
            Ok(Some((lo, hi)))
        };
        Ok(Self {
            linear,
            input: range("input_min", "input_max")?,
            output: range("output_min", "output_max")?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.input {
            Some((lo, hi)) => x.clamp(lo, hi)?,
            None => x.clone(),
        };
        let y = self.linear.forward(&x)?;
        Ok(match self.output {
            Some((lo, hi)) => y.clamp(lo, hi)?,
            None => y,
        })
    }
}

struct EncoderLayer {
    input_norm: RmsNorm,
    post_attention_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    post_ffn_norm: RmsNorm,
    q_proj: ClippedLinear,
    k_proj: ClippedLinear,
    v_proj: ClippedLinear,
    o_proj: ClippedLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
}

/// The vision tower and its projection into the text model.
pub struct VisionTower {
    cfg: VisionConfig,
    input_proj: Linear,
    /// `[2, table, D]`: x rows, then y rows.
    position_table: Vec<f32>,
    layers: Vec<EncoderLayer>,
    /// `(bias, scale)` of the standardisation.
    standardize: Option<(Tensor, Tensor)>,
    projection: Linear,
    text_hidden: usize,
    device: Device,
}

/// Query rows per attention tile: bounds the score matrix of a large image.
const QUERY_TILE: usize = 1024;

impl VisionTower {
    /// Loads the tower from `vision_tower.*` and `embed_vision.*` of a
    /// source positioned at the multimodal model's root (`model.`).
    pub fn load(cfg: VisionConfig, text_hidden: usize, src: &Weights<'_>) -> Result<Self> {
        let d = cfg.hidden_size;
        let hd = cfg.head_dim;
        let p = "vision_tower.";
        let patch_values = cfg.patch_size * cfg.patch_size * 3;
        let input_proj = src.linear(
            &format!("{p}patch_embedder.input_proj.weight"),
            d,
            patch_values,
        )?;
        let position_table = src
            .vector(
                &format!("{p}patch_embedder.position_embedding_table"),
                &[2, cfg.position_table_size, d],
            )?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                Some(src.vector(name, &[dim])?),
                cfg.rms_norm_eps,
            ))
        };
        let clipped = |name: &str, out: usize, inp: usize| {
            ClippedLinear::load(src, name, out, inp, cfg.clipped_linears)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let l = format!("{p}encoder.layers.{i}.");
            let a = format!("{l}self_attn.");
            let m = format!("{l}mlp.");
            layers.push(EncoderLayer {
                input_norm: norm(&format!("{l}input_layernorm.weight"), d)?,
                post_attention_norm: norm(&format!("{l}post_attention_layernorm.weight"), d)?,
                pre_ffn_norm: norm(&format!("{l}pre_feedforward_layernorm.weight"), d)?,
                post_ffn_norm: norm(&format!("{l}post_feedforward_layernorm.weight"), d)?,
                q_proj: clipped(&format!("{a}q_proj"), cfg.num_heads * hd, d)?,
                k_proj: clipped(&format!("{a}k_proj"), cfg.num_kv_heads * hd, d)?,
                v_proj: clipped(&format!("{a}v_proj"), cfg.num_kv_heads * hd, d)?,
                o_proj: clipped(&format!("{a}o_proj"), d, cfg.num_heads * hd)?,
                q_norm: norm(&format!("{a}q_norm.weight"), hd)?,
                k_norm: norm(&format!("{a}k_norm.weight"), hd)?,
                v_norm: RmsNorm::new(None, cfg.rms_norm_eps),
                gate: clipped(&format!("{m}gate_proj"), cfg.intermediate_size, d)?,
                up: clipped(&format!("{m}up_proj"), cfg.intermediate_size, d)?,
                down: clipped(&format!("{m}down_proj"), d, cfg.intermediate_size)?,
            });
        }
        let standardize = if cfg.standardize {
            Some((
                src.vector(&format!("{p}std_bias"), &[d])?,
                src.vector(&format!("{p}std_scale"), &[d])?,
            ))
        } else {
            None
        };
        let projection = src.linear("embed_vision.embedding_projection.weight", text_hidden, d)?;
        Ok(Self {
            cfg,
            input_proj,
            position_table,
            layers,
            standardize,
            projection,
            text_hidden,
            device: Device::Cpu,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The image's soft tokens in the text model's space, `[tokens, hidden]`.
    pub fn encode(&self, image: VisionInput<'_>) -> Result<Tensor> {
        let n = image.positions.len();
        let values = self.cfg.patch_size * self.cfg.patch_size * 3;
        if n == 0 || image.patches.len() != n * values {
            return Err(ModelError::Input(format!(
                "an image needs {values} values per patch position ({} values for {n} positions)",
                image.patches.len()
            )));
        }
        let (pw, ph) = grid(image.positions);
        let k = self.cfg.pooling;
        if !pw.is_multiple_of(k) || !ph.is_multiple_of(k) || pw * ph != n {
            return Err(ModelError::Input(format!(
                "the patches form a {pw}×{ph} grid (with {n} patches), not whole {k}×{k} blocks"
            )));
        }
        if pw.max(ph) > self.cfg.position_table_size {
            return Err(ModelError::Input(format!(
                "the image is {pw}×{ph} patches; the position table holds {}",
                self.cfg.position_table_size
            )));
        }
        let d = self.cfg.hidden_size;
        let pixels = Tensor::from_slice(image.patches, (n, values), &self.device)?;
        let pixels = ((pixels - 0.5)? * 2.0)?;
        let mut h = self.input_proj.forward(&pixels)?;
        h = (h + self.position_embeddings(image.positions)?)?;
        let (cos, sin) = self.rope(image.positions)?;
        for layer in &self.layers {
            h = self.layer(layer, &h, &cos, &sin)?;
        }
        let pooled = pool(&h, image.positions, pw, k, d, &self.device)?;
        let mut x = (pooled * (d as f64).sqrt() as f32 as f64)?;
        if let Some((bias, scale)) = &self.standardize {
            x = x.broadcast_sub(bias)?.broadcast_mul(scale)?;
        }
        let x = RmsNorm::new(None, self.cfg.rms_norm_eps).forward(&x)?;
        let out = self.projection.forward(&x)?;
        debug_assert_eq!(out.dim(1)?, self.text_hidden);
        Ok(out)
    }

    fn position_embeddings(&self, positions: &[(u32, u32)]) -> Result<Tensor> {
        let d = self.cfg.hidden_size;
        let table = self.cfg.position_table_size;
        let mut out = Vec::with_capacity(positions.len() * d);
        for &(x, y) in positions {
            let xr = &self.position_table[x as usize * d..][..d];
            let yr = &self.position_table[(table + y as usize) * d..][..d];
            out.extend(xr.iter().zip(yr).map(|(a, b)| a + b));
        }
        Ok(Tensor::from_vec(out, (positions.len(), d), &self.device)?)
    }

    /// `(cos, sin)`, each `[n, head_dim]`: per patch `[fx, fx, fy, fy]`,
    /// with `f = position · θ^(−2i / (head_dim / 2))`, `i < head_dim / 4`.
    fn rope(&self, positions: &[(u32, u32)]) -> Result<(Tensor, Tensor)> {
        let hd = self.cfg.head_dim;
        let spatial = hd / 2;
        let inv_freq: Vec<f32> = (0..spatial / 2)
            .map(|i| 1.0f32 / (self.cfg.rope_theta as f32).powf((2 * i) as f32 / spatial as f32))
            .collect();
        let mut freqs = Vec::with_capacity(positions.len() * hd);
        for &(x, y) in positions {
            for pos in [x, y] {
                let row: Vec<f32> = inv_freq.iter().map(|f| pos as f32 * f).collect();
                freqs.extend_from_slice(&row);
                freqs.extend_from_slice(&row);
            }
        }
        let emb = Tensor::from_vec(freqs, (positions.len(), hd), &self.device)?;
        Ok((emb.cos()?, emb.sin()?))
    }

    fn layer(&self, l: &EncoderLayer, h: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let a = self.attention(l, &l.input_norm.forward(h)?, cos, sin)?;
        let h = (h + l.post_attention_norm.forward(&a)?)?;
        let x = l.pre_ffn_norm.forward(&h)?;
        let m = l
            .down
            .forward(&gated_gelu(&l.gate.forward(&x)?, &l.up.forward(&x)?)?)?;
        Ok((h + l.post_ffn_norm.forward(&m)?)?)
    }

    fn attention(
        &self,
        l: &EncoderLayer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let q = l
            .q_norm
            .forward(&l.q_proj.forward(x)?.reshape((n, nh, hd))?)?;
        let k = l
            .k_norm
            .forward(&l.k_proj.forward(x)?.reshape((n, nkv, hd))?)?;
        let v = l
            .v_norm
            .forward(&l.v_proj.forward(x)?.reshape((n, nkv, hd))?)?;
        let q = rope_2d(&q, cos, sin)?.transpose(0, 1)?.contiguous()?;
        let k = rope_2d(&k, cos, sin)?.transpose(0, 1)?.contiguous()?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let group = nh / nkv;
        let mut heads = Vec::with_capacity(nh);
        for head in 0..nh {
            let qh = q.get(head)?;
            let kt = k.get(head / group)?.t()?.contiguous()?;
            let vh = v.get(head / group)?;
            let mut tiles = Vec::with_capacity(n.div_ceil(QUERY_TILE));
            for start in (0..n).step_by(QUERY_TILE) {
                let rows = QUERY_TILE.min(n - start);
                // Scaling 1.0: the q/k norms set the scale.
                let scores = qh.narrow(0, start, rows)?.matmul(&kt)?;
                tiles.push(softmax_last_dim(&scores)?.matmul(&vh)?);
            }
            heads.push(Tensor::cat(&tiles, 0)?);
        }
        let out = Tensor::stack(&heads, 1)?.reshape((n, nh * hd))?;
        l.o_proj.forward(&out)
    }
}

/// Patch-grid width and height from the positions.
fn grid(positions: &[(u32, u32)]) -> (usize, usize) {
    let w = positions
        .iter()
        .map(|p| p.0)
        .max()
        .map_or(0, |x| x as usize + 1);
    let h = positions
        .iter()
        .map(|p| p.1)
        .max()
        .map_or(0, |y| y as usize + 1);
    (w, h)
}

/// Rotate-half RoPE applied separately to each half of the head: the first
/// half with the x angles, the second with the y angles. `x`: `[n, heads, hd]`.
fn rope_2d(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let half = hd / 2;
    let mut parts = Vec::with_capacity(2);
    for i in 0..2 {
        let xp = x.narrow(D::Minus1, i * half, half)?;
        let c = cos.narrow(D::Minus1, i * half, half)?.unsqueeze(1)?;
        let s = sin.narrow(D::Minus1, i * half, half)?.unsqueeze(1)?;
        let a = xp.narrow(D::Minus1, 0, half / 2)?;
        let b = xp.narrow(D::Minus1, half / 2, half / 2)?;
        let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
        parts.push((xp.broadcast_mul(&c)? + rotated.broadcast_mul(&s)?)?);
    }
    Ok(Tensor::cat(&parts, D::Minus1)?)
}

/// Average of each `k × k` block of patches, blocks in row-major order, as
/// the reference's one-hot product does (each patch weighted by `1/k²`).
fn pool(
    h: &Tensor,
    positions: &[(u32, u32)],
    pw: usize,
    k: usize,
    d: usize,
    device: &Device,
) -> Result<Tensor> {
    let blocks_x = pw / k;
    let blocks = positions.len() / (k * k);
    let rows = h.to_vec2::<f32>()?;
    let weight = 1.0f32 / (k * k) as f32;
    let mut out = vec![0.0f32; blocks * d];
    for (row, &(x, y)) in rows.iter().zip(positions) {
        let block = x as usize / k + blocks_x * (y as usize / k);
        let dst = &mut out[block * d..(block + 1) * d];
        for (o, v) in dst.iter_mut().zip(row) {
            *o += weight * v;
        }
    }
    Ok(Tensor::from_vec(out, (blocks, d), device)?)
}
