//! The Gemma 4 text decoder, mirroring the Hugging Face reference
//! (`Gemma4TextModel.forward`) step by step. Gemma 3 runs through the same
//! code with its conventions switched (see [`Conventions`]).
//!
//! Per layer: input norm → attention (q/k/v norms, RoPE, sliding or full mask,
//! shared or own K/V) → post-attention norm + residual → MLP (plus the expert
//! branch on MoE models) → post-FFN norm + residual → per-layer-embedding
//! branch (E2B/E4B) → `layer_scalar`.

use candle_core::{Device, Tensor, D};

use crate::cache::{KvCache, KvStore, Queries, Visibility};
use crate::config::{
    AttentionKind, ImageAttention, KvSource, LayerSpec, MoeSpec, RopeSpec, TextConfig,
};
use crate::error::{ModelError, Result};
use crate::layers::{gated_gelu, ids_tensor, softcap, softmax_last_dim, RmsNorm, Rotary};
use crate::loader::Weights;
use crate::lora::{LoraAdapter, Projection};
use crate::storage::{Embedding, Experts, Linear};

/// Which positions need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every input position (`[n, vocab]`).
    All,
    /// Only the last input position (`[1, vocab]`).
    Last,
}

/// One sequence's share of a batched step.
#[derive(Debug, Clone, Copy)]
pub struct BatchSeq<'a> {
    /// The tokens to run (a prompt chunk, or one decode token).
    pub ids: &'a [u32],
    /// Position of the first token (tokens already in the sequence's cache).
    pub start: usize,
    /// Which logits this sequence needs, if any.
    pub logits: Option<LogitsFor>,
    /// Rows of `ids` whose embeddings come from an encoder (image soft
    /// tokens), not from the token table.
    pub soft: Option<SoftTokens<'a>>,
    /// The LoRA adapter this sequence runs with, if any.
    pub lora: Option<&'a LoraAdapter>,
}

/// Encoder outputs that replace token embeddings, as the reference's
/// multimodal wrapper scatters them: at these rows the scaled token embedding
/// is replaced by the given row (unscaled), and the per-layer-embedding table
/// is read at the pad id (the context part sees the replaced row). On models
/// with bidirectional image attention each image is one of `blocks`, and must
/// lie whole in the step (the engine never splits one).
#[derive(Debug, Clone, Copy)]
pub struct SoftTokens<'a> {
    /// Indices into the sequence's `ids`, ascending.
    pub rows: &'a [usize],
    /// `rows.len() × hidden` values, one row per index.
    pub embeds: &'a [f32],
    /// `[start, end)` runs of `ids` whose positions attend to each other
    /// (images, on models with bidirectional image attention); audio rows
    /// belong to none.
    pub blocks: &'a [(usize, usize)],
}

/// Where a sequence's tokens sit in the flat batch.
#[derive(Debug, Clone, Copy)]
struct Span {
    seq: usize,
    offset: usize,
    len: usize,
    start: usize,
}

/// cos/sin of one RoPE kind for every position of a step.
struct RopeTable {
    spec: RopeSpec,
    cos: Tensor,
    sin: Tensor,
}

/// What every layer of one step shares.
struct Step<'a> {
    spans: &'a [Span],
    /// Per span, the runs of positions that see each other whole
    /// (bidirectional image attention); empty otherwise.
    blocks: &'a [Vec<(usize, usize)>],
    image_attention: ImageAttention,
    rope: &'a [RopeTable],
    /// Per span, its adapter.
    lora: &'a [Option<&'a LoraAdapter>],
}

/// What a forward pass gives for one sequence's requested positions.
#[derive(Debug, Clone)]
pub struct OutputRows {
    /// `[rows, vocab]`, softcapped.
    pub logits: Tensor,
    /// `[rows, hidden]`: the final norm's output, from which the head
    /// computed `logits`.
    pub hidden: Tensor,
}

/// Intermediate values recorded during a forward pass, for diagnosing a
/// mismatch against the reference.
#[derive(Debug, Default)]
pub struct ForwardTrace {
    /// `[n, hidden]` per entry: the scaled embedding, each layer's output,
    /// then the final norm's output (the reference's `hidden_states` layout).
    pub hidden: Vec<Tensor>,
    /// MoE only: per layer, per token, the chosen experts in rank order.
    pub routing: Vec<Vec<Vec<usize>>>,
}

/// The text model with its weights.
pub struct Gemma4 {
    cfg: TextConfig,
    embed: Embedding,
    embed_scale: f64,
    head: Linear,
    ple: Option<PerLayerEmbeddings>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    device: Device,
}

struct PerLayerEmbeddings {
    /// `[vocab, layers · dim]`, read by row.
    table: Embedding,
    projection: Linear,
    norm: RmsNorm,
    dim: usize,
}

struct DecoderLayer {
    index: usize,
    spec: LayerSpec,
    input_norm: RmsNorm,
    post_attention_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    post_ffn_norm: RmsNorm,
    attn: Attention,
    mlp: Mlp,
    moe: Option<MoeBlock>,
    ple: Option<LayerPle>,
    layer_scalar: Option<f64>,
}

struct Attention {
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    /// `None` on KV-shared layers, which read a producer's cache instead.
    own_kv: Option<KvProjection>,
    num_heads: usize,
    scale: f64,
    sliding_window: usize,
}

struct KvProjection {
    k_proj: Linear,
    /// `None` when V is the raw K projection (`attention_k_eq_v`).
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
    v_norm: Option<RmsNorm>,
}

pub(crate) struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct MoeBlock {
    spec: MoeSpec,
    router_norm: RmsNorm,
    router_scale: Tensor,
    router_proj: Linear,
    per_expert_scale: Vec<f32>,
    /// Per expert: `gate_up` `[2 · moe_intermediate, hidden]` (gate rows, then
    /// up rows) and `down` `[hidden, moe_intermediate]`.
    experts: Experts,
    pre_ffn_norm_2: RmsNorm,
    post_ffn_norm_1: RmsNorm,
    post_ffn_norm_2: RmsNorm,
}

struct LayerPle {
    gate: Linear,
    projection: Linear,
    post_norm: RmsNorm,
}

impl Gemma4 {
    /// Builds the model from a configuration and a loader context.
    pub fn load(cfg: TextConfig, src: &Weights<'_>) -> Result<Self> {
        let device = Device::Cpu;
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let gemma3_offset = cfg.is_gemma3() && !src.norms_include_gemma3_offset();
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            let mut w = src.vector(name, &[dim])?;
            if gemma3_offset {
                w = (w + 1.0)?;
            }
            Ok(RmsNorm::new(Some(w), eps))
        };
        let (embed, embed_stored) = src.embedding("embed_tokens.weight", cfg.vocab_size, h)?;
        // The reference multiplies by sqrt(H) cast to the compute dtype (f32 here).
        let embed_scale = f64::from((h as f32).sqrt());
        let n_layers = cfg.num_layers();
        let ple = if cfg.ple_dim > 0 {
            let d = cfg.ple_dim;
            Some(PerLayerEmbeddings {
                table: src
                    .embedding(
                        "embed_tokens_per_layer.weight",
                        cfg.vocab_size,
                        n_layers * d,
                    )?
                    .0,
                projection: src.linear("per_layer_model_projection.weight", n_layers * d, h)?,
                norm: norm("per_layer_projection_norm.weight", d)?,
                dim: d,
            })
        } else {
            None
        };
        let mut layers = Vec::with_capacity(n_layers);
        for (i, spec) in cfg.layers.iter().enumerate() {
            let p = format!("layers.{i}.");
            let nh = cfg.num_attention_heads;
            let hd = spec.head_dim;
            let kvd = spec.num_kv_heads * hd;
            let own_kv = match spec.kv {
                KvSource::Own => Some(KvProjection {
                    k_proj: src.linear(&format!("{p}self_attn.k_proj.weight"), kvd, h)?,
                    v_proj: if spec.v_is_k {
                        None
                    } else {
                        Some(src.linear(&format!("{p}self_attn.v_proj.weight"), kvd, h)?)
                    },
                    k_norm: norm(&format!("{p}self_attn.k_norm.weight"), hd)?,
                    v_norm: cfg.conventions.v_norm.then(|| RmsNorm::new(None, eps)),
                }),
                // k_proj / v_proj / k_norm may be stored on shared layers; they are never used.
                KvSource::SharedFrom(_) => None,
            };
            let attn = Attention {
                q_proj: src.linear(&format!("{p}self_attn.q_proj.weight"), nh * hd, h)?,
                o_proj: src.linear(&format!("{p}self_attn.o_proj.weight"), h, nh * hd)?,
                q_norm: norm(&format!("{p}self_attn.q_norm.weight"), hd)?,
                own_kv,
                num_heads: nh,
                scale: cfg.conventions.attention_scale,
                sliding_window: cfg.sliding_window,
            };
            let mlp = Mlp::load(src, &format!("{p}mlp."), spec.intermediate_size, h)?;
            let moe = match cfg.moe {
                Some(m) => Some(load_moe(src, &p, m, h, eps, &norm)?),
                None => None,
            };
            let ple = match &ple {
                Some(t) => Some(LayerPle {
                    gate: src.linear(&format!("{p}per_layer_input_gate.weight"), t.dim, h)?,
                    projection: src.linear(&format!("{p}per_layer_projection.weight"), h, t.dim)?,
                    post_norm: norm(&format!("{p}post_per_layer_input_norm.weight"), h)?,
                }),
                None => None,
            };
            let layer_scalar = if cfg.conventions.layer_scalar {
                let s = src.vector(&format!("{p}layer_scalar"), &[1])?;
                Some(f64::from(s.to_vec1::<f32>()?[0]))
            } else {
                None
            };
            layers.push(DecoderLayer {
                index: i,
                spec: spec.clone(),
                input_norm: norm(&format!("{p}input_layernorm.weight"), h)?,
                post_attention_norm: norm(&format!("{p}post_attention_layernorm.weight"), h)?,
                pre_ffn_norm: norm(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                post_ffn_norm: norm(&format!("{p}post_feedforward_layernorm.weight"), h)?,
                attn,
                mlp,
                moe,
                ple,
                layer_scalar,
            });
        }
        let norm = norm("norm.weight", h)?;
        let head = src.tied_head(&embed_stored)?;
        Ok(Self {
            cfg,
            embed,
            embed_scale,
            head,
            ple,
            layers,
            norm,
            device,
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// A cache sized for this model's layers.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.num_layers())
    }

    /// Runs `ids` at positions `cache.len()..`, appends their K/V to the
    /// cache, and returns softcapped logits for the requested positions.
    pub fn forward(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        want: LogitsFor,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        self.forward_with_soft_tokens(ids, None, cache, want, trace)
    }

    /// [`forward`](Self::forward) with some rows' embeddings given by an
    /// encoder (image soft tokens).
    pub fn forward_with_soft_tokens(
        &self,
        ids: &[u32],
        soft: Option<SoftTokens<'_>>,
        cache: &mut KvCache,
        want: LogitsFor,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        let seq = BatchSeq {
            ids,
            start: cache.len(),
            logits: Some(want),
            soft,
            lora: None,
        };
        let mut out = self.forward_batch(&[seq], cache, trace)?;
        cache.advance(ids.len());
        out.pop()
            .flatten()
            .ok_or_else(|| ModelError::Input("no logits were produced".into()))
    }

    /// One model step over a flat batch: the tokens of several sequences
    /// (prompt chunks or single decode tokens) go through every dense layer
    /// together; attention runs per sequence against its own K/V in `kv`.
    /// Returns, per sequence, the logits it asked for.
    pub fn forward_batch(
        &self,
        seqs: &[BatchSeq<'_>],
        kv: &mut dyn KvStore,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(self
            .forward_batch_rows(seqs, kv, trace)?
            .into_iter()
            .map(|rows| rows.map(|r| r.logits))
            .collect())
    }

    /// [`forward_batch`](Self::forward_batch), with the final norm's output
    /// (the head's input) beside each sequence's logits, as a drafter that
    /// continues from the target's hidden state needs it.
    pub fn forward_batch_rows(
        &self,
        seqs: &[BatchSeq<'_>],
        kv: &mut dyn KvStore,
        mut trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<Option<OutputRows>>> {
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(seqs.len());
        // (flat row, source row) of every soft token in the batch.
        let mut soft_rows: Vec<(usize, &[f32])> = Vec::new();
        let hidden = self.cfg.hidden_size;
        for s in seqs {
            if let Some(soft) = s.soft {
                if soft.embeds.len() != soft.rows.len() * hidden {
                    return Err(ModelError::Input(format!(
                        "{} soft-token rows need {} values, got {}",
                        soft.rows.len(),
                        soft.rows.len() * hidden,
                        soft.embeds.len()
                    )));
                }
                for (i, &row) in soft.rows.iter().enumerate() {
                    if row >= s.ids.len() {
                        return Err(ModelError::Input(format!(
                            "soft-token row {row} is outside the {} tokens of the step",
                            s.ids.len()
                        )));
                    }
                    soft_rows.push((ids.len() + row, &soft.embeds[i * hidden..(i + 1) * hidden]));
                }
            }
            if s.ids.is_empty() {
                return Err(ModelError::Input(
                    "cannot run the model on zero tokens".into(),
                ));
            }
            spans.push(Span {
                seq: spans.len(),
                offset: ids.len(),
                len: s.ids.len(),
                start: s.start,
            });
            ids.extend_from_slice(s.ids);
            positions.extend(s.start..s.start + s.ids.len());
        }
        // Bidirectional image attention: each run of consecutive soft tokens
        // is one image, whose tokens see each other on sliding layers.
        let blocks: Vec<Vec<(usize, usize)>> = seqs
            .iter()
            .map(|s| match s.soft {
                Some(soft) if self.cfg.image_attention.is_bidirectional() => soft
                    .blocks
                    .iter()
                    .map(|&(b, e)| (s.start + b, s.start + e))
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        // Placeholder ids may lie outside the table (the reference reads the
        // pad row there, and overwrites it).
        let pad = self.cfg.pad_token_id.unwrap_or(0);
        for &(row, _) in &soft_rows {
            ids[row] = pad;
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.cfg.vocab_size
            )));
        }
        let mut h = (self.embed.lookup(&ids, &self.device)? * self.embed_scale)?;
        if !soft_rows.is_empty() {
            let mut rows = h.flatten_all()?.to_vec1::<f32>()?;
            for &(row, embed) in &soft_rows {
                rows[row * hidden..(row + 1) * hidden].copy_from_slice(embed);
            }
            h = Tensor::from_vec(rows, (ids.len(), hidden), &self.device)?;
        }
        let ple = match &self.ple {
            Some(p) => Some(self.per_layer_inputs(p, &ids, &h)?),
            None => None,
        };
        if let Some(t) = trace.as_deref_mut() {
            t.hidden.push(h.clone());
        }
        // cos/sin once per distinct RoPE (sliding, full), not once per layer.
        let mut rope: Vec<RopeTable> = Vec::new();
        for layer in &self.layers {
            if !rope.iter().any(|r| r.spec == layer.spec.rope) {
                let (cos, sin) = Rotary::new(&layer.spec.rope).cos_sin(&positions, &self.device)?;
                rope.push(RopeTable {
                    spec: layer.spec.rope,
                    cos,
                    sin,
                });
            }
        }
        let lora: Vec<Option<&LoraAdapter>> = seqs.iter().map(|s| s.lora).collect();
        let step = Step {
            spans: &spans,
            blocks: &blocks,
            image_attention: self.cfg.image_attention,
            rope: &rope,
            lora: &lora,
        };
        for layer in &self.layers {
            let ple_i = match &ple {
                Some(p) => Some(p.narrow(1, layer.index, 1)?.squeeze(1)?),
                None => None,
            };
            h = layer.forward(&h, &step, kv, ple_i.as_ref(), trace.as_deref_mut())?;
            if let Some(t) = trace.as_deref_mut() {
                t.hidden.push(h.clone());
            }
        }
        // Rows that need logits, then the final norm and head on those only.
        let mut rows = Vec::new();
        let mut row_of = Vec::with_capacity(seqs.len());
        for (s, span) in seqs.iter().zip(&spans) {
            match s.logits {
                Some(LogitsFor::All) => {
                    row_of.push(Some((rows.len(), span.len)));
                    rows.extend((span.offset..span.offset + span.len).map(|r| r as u32));
                }
                Some(LogitsFor::Last) => {
                    row_of.push(Some((rows.len(), 1)));
                    rows.push((span.offset + span.len - 1) as u32);
                }
                None => row_of.push(None),
            }
        }
        if rows.is_empty() {
            return Ok(vec![None; seqs.len()]);
        }
        let h = h.index_select(&ids_tensor(&rows, &self.device)?, 0)?;
        let h = self.norm.forward(&h)?;
        if let Some(t) = trace {
            t.hidden.push(h.clone());
        }
        let mut logits = self.head.forward(&h)?;
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits = softcap(&logits, cap)?;
        }
        row_of
            .into_iter()
            .map(|r| {
                r.map(|(first, n)| -> Result<OutputRows> {
                    Ok(OutputRows {
                        logits: logits.narrow(0, first, n)?,
                        hidden: h.narrow(0, first, n)?,
                    })
                })
                .transpose()
            })
            .collect()
    }

    /// Token embeddings as the first layer reads them (`[n, hidden]`,
    /// scaled by √hidden).
    pub fn scaled_embeddings(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.cfg.vocab_size
            )));
        }
        Ok((self.embed.lookup(ids, &self.device)? * self.embed_scale)?)
    }

    /// `(RMSNorm(proj(h0) · H^-½) + table[ids] · √d) · 2^-½`, as `[n, layers, d]`.
    fn per_layer_inputs(&self, p: &PerLayerEmbeddings, ids: &[u32], h0: &Tensor) -> Result<Tensor> {
        let n = h0.dim(0)?;
        let layers = self.cfg.num_layers();
        let token = (p.table.lookup(ids, &self.device)? * f64::from((p.dim as f32).sqrt()))?;
        let token = token.reshape((n, layers, p.dim))?;
        let context = (p.projection.forward(h0)? * (self.cfg.hidden_size as f64).powf(-0.5))?;
        let context = p.norm.forward(&context.reshape((n, layers, p.dim))?)?;
        Ok(((context + token)? * std::f64::consts::FRAC_1_SQRT_2)?)
    }
}

/// A prompt's encoder rows laid out from its placeholder ids.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlacedSoftTokens {
    pub rows: Vec<usize>,
    pub embeds: Vec<f32>,
    /// The images' runs (they attend to each other where the model says so).
    pub blocks: Vec<(usize, usize)>,
}

impl PlacedSoftTokens {
    pub fn as_soft_tokens(&self) -> SoftTokens<'_> {
        SoftTokens {
            rows: &self.rows,
            embeds: &self.embeds,
            blocks: &self.blocks,
        }
    }
}

/// One kind of media in a prompt: its placeholder id and its items' soft
/// tokens, in prompt order (each `[tokens · hidden]` values; a video gives
/// one item per frame, each frame being its own run of placeholders).
#[derive(Debug, Clone, Copy)]
pub struct SoftTokenSource<'a> {
    pub token: u32,
    pub items: &'a [&'a [f32]],
    /// What an item is called in errors ("image", "audio clip", "video frame").
    pub kind: &'static str,
    /// Whether an item's run is a vision block (its soft tokens see each
    /// other where the model's image attention is bidirectional).
    pub vision: bool,
}

impl<'a> SoftTokenSource<'a> {
    pub fn images(token: u32, items: &'a [&'a [f32]]) -> Self {
        Self {
            token,
            items,
            kind: "image",
            vision: true,
        }
    }

    pub fn audio(token: u32, items: &'a [&'a [f32]]) -> Self {
        Self {
            token,
            items,
            kind: "audio clip",
            vision: false,
        }
    }

    /// A prompt's video frames, in order (each frame its own run).
    pub fn video_frames(token: u32, items: &'a [&'a [f32]]) -> Self {
        Self {
            token,
            items,
            kind: "video frame",
            vision: true,
        }
    }
}

/// Gives each run of a source's placeholder ids the source's next item,
/// checking that every run gets exactly its rows.
pub fn place_soft_tokens(
    ids: &[u32],
    hidden: usize,
    sources: &[SoftTokenSource<'_>],
) -> Result<PlacedSoftTokens> {
    let mut out = PlacedSoftTokens::default();
    let mut next: Vec<_> = sources.iter().map(|s| s.items.iter()).collect();
    let mut i = 0;
    while i < ids.len() {
        let t = ids[i];
        let Some(k) = sources.iter().position(|s| s.token == t) else {
            i += 1;
            continue;
        };
        let end = i + ids[i..].iter().take_while(|&&x| x == t).count();
        let kind = sources[k].kind;
        let values = next[k].next().ok_or_else(|| {
            ModelError::Input(format!(
                "the prompt holds more {kind} placeholders than {kind}s"
            ))
        })?;
        if values.len() != (end - i) * hidden {
            return Err(ModelError::Input(format!(
                "a {kind} of {} soft tokens meets a run of {} placeholders at {i}",
                values.len() / hidden.max(1),
                end - i
            )));
        }
        if sources[k].vision {
            out.blocks.push((i, end));
        }
        out.rows.extend(i..end);
        out.embeds.extend_from_slice(values);
        i = end;
    }
    if next.iter_mut().any(|items| items.next().is_some()) {
        return Err(ModelError::Input(
            "more media than placeholders in the prompt".into(),
        ));
    }
    Ok(out)
}

fn load_moe(
    src: &Weights<'_>,
    p: &str,
    m: MoeSpec,
    h: usize,
    eps: f64,
    norm: &dyn Fn(&str, usize) -> Result<RmsNorm>,
) -> Result<MoeBlock> {
    let e = m.num_experts;
    let i = m.intermediate_size;
    Ok(MoeBlock {
        spec: m,
        router_norm: RmsNorm::new(None, eps),
        router_scale: src.vector(&format!("{p}router.scale"), &[h])?,
        router_proj: src.linear(&format!("{p}router.proj.weight"), e, h)?,
        per_expert_scale: src
            .vector(&format!("{p}router.per_expert_scale"), &[e])?
            .to_vec1()?,
        experts: src.experts(
            &format!("{p}experts.gate_up_proj"),
            &format!("{p}experts.down_proj"),
            e,
            i,
            h,
        )?,
        pre_ffn_norm_2: norm(&format!("{p}pre_feedforward_layernorm_2.weight"), h)?,
        post_ffn_norm_1: norm(&format!("{p}post_feedforward_layernorm_1.weight"), h)?,
        post_ffn_norm_2: norm(&format!("{p}post_feedforward_layernorm_2.weight"), h)?,
    })
}

impl Step<'_> {
    /// `y` (the base product of `x` by `proj` of `layer`) plus each
    /// sequence's LoRA term for its own rows: one low-rank product per
    /// adapter over all the rows that use it.
    fn adapt(&self, layer: usize, proj: Projection, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let mut groups: Vec<(&crate::lora::LoraModule, Vec<u32>)> = Vec::new();
        for sp in self.spans {
            let Some(module) = self.lora[sp.seq].and_then(|a| a.module(layer, proj)) else {
                continue;
            };
            let rows = (sp.offset..sp.offset + sp.len).map(|r| r as u32);
            match groups.iter_mut().find(|(m, _)| std::ptr::eq(*m, module)) {
                Some((_, g)) => g.extend(rows),
                None => groups.push((module, rows.collect())),
            }
        }
        crate::lora::add_terms(&groups, x, y)
    }
}

impl DecoderLayer {
    fn forward(
        &self,
        h: &Tensor,
        step: &Step<'_>,
        kv: &mut dyn KvStore,
        ple: Option<&Tensor>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        let residual = h;
        let a = self.attention(&self.input_norm.forward(h)?, step, kv)?;
        let h = (residual + self.post_attention_norm.forward(&a)?)?;
        let residual = &h;
        let adapt = |proj, x: &Tensor, y| step.adapt(self.index, proj, x, y);
        let mut m = self
            .mlp
            .forward_adapted(&self.pre_ffn_norm.forward(&h)?, &adapt)?;
        if let Some(moe) = &self.moe {
            let m1 = moe.post_ffn_norm_1.forward(&m)?;
            let (experts, routing) = moe.forward(residual)?;
            if let Some(t) = trace {
                t.routing.push(routing);
            }
            m = (m1 + moe.post_ffn_norm_2.forward(&experts)?)?;
        }
        let mut h = (residual + self.post_ffn_norm.forward(&m)?)?;
        if let (Some(lp), Some(ple)) = (&self.ple, ple) {
            let g = gated_gelu(&lp.gate.forward(&h)?, ple)?;
            h = (&h + lp.post_norm.forward(&lp.projection.forward(&g)?)?)?;
        }
        if let Some(s) = self.layer_scalar {
            h = (h * s)?;
        }
        Ok(h)
    }

    fn attention(&self, x: &Tensor, step: &Step<'_>, kv: &mut dyn KvStore) -> Result<Tensor> {
        let at = &self.attn;
        let n = x.dim(0)?;
        let hd = self.spec.head_dim;
        let kvh = self.spec.num_kv_heads;
        let spans = step.spans;
        let table = step
            .rope
            .iter()
            .find(|r| r.spec == self.spec.rope)
            .ok_or_else(|| ModelError::Input(format!("no RoPE table for layer {}", self.index)))?;
        let (cos, sin) = (&table.cos, &table.sin);
        // q, k and v read the same input: one product where they can.
        let mut projections = vec![&at.q_proj];
        if let Some(p) = &at.own_kv {
            projections.push(&p.k_proj);
            projections.extend(p.v_proj.as_ref());
        }
        let mut kinds = vec![Projection::Q];
        if let Some(p) = &at.own_kv {
            kinds.push(Projection::K);
            kinds.extend(p.v_proj.as_ref().map(|_| Projection::V));
        }
        let mut projected = Linear::forward_many(&projections, x)?
            .into_iter()
            .zip(kinds)
            .map(|(y, kind)| step.adapt(self.index, kind, x, y));
        let mut next = || {
            projected
                .next()
                .ok_or_else(|| ModelError::Input("a projection is missing".into()))?
        };
        let q = next()?.reshape((n, at.num_heads, hd))?;
        let q = Rotary::apply(&at.q_norm.forward(&q)?, cos, sin)?;
        if let Some(p) = &at.own_kv {
            let raw_k = next()?.reshape((n, kvh, hd))?;
            let v = match &p.v_proj {
                Some(_) => next()?.reshape((n, kvh, hd))?,
                None => raw_k.clone(),
            };
            let k = Rotary::apply(&p.k_norm.forward(&raw_k)?, cos, sin)?;
            let v = match &p.v_norm {
                Some(vn) => vn.forward(&v)?,
                None => v,
            };
            for sp in spans {
                kv.write(
                    self.index,
                    sp.seq,
                    sp.start,
                    &k.narrow(0, sp.offset, sp.len)?,
                    &v.narrow(0, sp.offset, sp.len)?,
                )?;
            }
        }
        let source = match self.spec.kv {
            KvSource::Own => self.index,
            KvSource::SharedFrom(j) => j,
        };
        let sliding = self.spec.kind == AttentionKind::Sliding;
        let image_blocks = match step.image_attention {
            ImageAttention::Causal => false,
            // Full layers stay strictly causal.
            ImageAttention::SlidingWindows => sliding,
            ImageAttention::EveryLayer => true,
        };
        // Every sequence's queries against its own context, in one call so
        // the store can share the work across the batch.
        let mut batch = Vec::with_capacity(spans.len());
        let mut q_parts = Vec::with_capacity(spans.len());
        for sp in spans {
            q_parts.push(q.narrow(0, sp.offset, sp.len)?);
        }
        for (sp, q) in spans.iter().zip(&q_parts) {
            let visibility = Visibility {
                window: sliding.then_some(at.sliding_window),
                blocks: if image_blocks {
                    &step.blocks[sp.seq]
                } else {
                    &[]
                },
                blocks_escape_window: step.image_attention == ImageAttention::EveryLayer,
            };
            let queries = Queries {
                q,
                start: sp.start,
                scale: at.scale,
                visibility,
            };
            batch.push((sp.seq, queries));
        }
        let mut outs = kv.attend_batch(source, batch)?;
        let out = if outs.len() == 1 {
            outs.pop()
                .ok_or_else(|| ModelError::Input("empty batch".into()))?
        } else {
            Tensor::cat(&outs, 0)?
        };
        step.adapt(self.index, Projection::O, &out, at.o_proj.forward(&out)?)
    }
}

impl Mlp {
    /// `{prefix}gate_proj`, `up_proj` and `down_proj`.
    pub(crate) fn load(src: &Weights<'_>, prefix: &str, inter: usize, h: usize) -> Result<Self> {
        Ok(Self {
            gate: src.linear(&format!("{prefix}gate_proj.weight"), inter, h)?,
            up: src.linear(&format!("{prefix}up_proj.weight"), inter, h)?,
            down: src.linear(&format!("{prefix}down_proj.weight"), h, inter)?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_adapted(x, &|_, _, y| Ok(y))
    }

    /// [`forward`](Self::forward), each projection's output `y` of input
    /// `x` passed through `adapt` (a LoRA term added).
    fn forward_adapted(
        &self,
        x: &Tensor,
        adapt: &dyn Fn(Projection, &Tensor, Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = Linear::forward_many(&[&self.gate, &self.up], x)?
            .try_into()
            .map_err(|_| ModelError::Input("gate/up projections missing".into()))?;
        let gate = adapt(Projection::Gate, x, gate)?;
        let up = adapt(Projection::Up, x, up)?;
        let g = gated_gelu(&gate, &up)?;
        adapt(Projection::Down, &g, self.down.forward(&g)?)
    }
}

impl MoeBlock {
    /// Routes each token of the residual stream `r` to its top-k experts and
    /// returns the weighted expert output plus the chosen experts per token.
    /// Only the chosen experts are computed.
    fn forward(&self, r: &Tensor) -> Result<(Tensor, Vec<Vec<usize>>)> {
        let (n, h) = r.dims2()?;
        let x = self
            .router_norm
            .forward(r)?
            .broadcast_mul(&self.router_scale)?;
        let x = (x * (h as f64).powf(-0.5))?;
        let probs = softmax_last_dim(&self.router_proj.forward(&x)?)?.to_vec2::<f32>()?;
        let x2 = self.pre_ffn_norm_2.forward(r)?;
        let k = self.spec.top_k;
        let mut routing = Vec::with_capacity(n);
        // Per expert: the tokens routed to it and their weights.
        let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.spec.num_experts];
        for (t, p) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            order.truncate(k);
            let sum: f32 = order.iter().map(|&e| p[e]).sum();
            for &e in &order {
                by_expert[e].0.push(t as u32);
                by_expert[e].1.push(p[e] / sum * self.per_expert_scale[e]);
            }
            routing.push(order);
        }
        let inter = self.spec.intermediate_size;
        let mut out = Tensor::zeros((n, h), r.dtype(), r.device())?;
        for (e, (tokens, weights)) in by_expert.iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let idx = ids_tensor(tokens, r.device())?;
            let xs = x2.index_select(&idx, 0)?;
            let gu = self.experts.gate_up[e].forward(&xs)?;
            let act = gated_gelu(
                &gu.narrow(D::Minus1, 0, inter)?,
                &gu.narrow(D::Minus1, inter, inter)?,
            )?;
            let y = self.experts.down[e].forward(&act.contiguous()?)?;
            let w = Tensor::from_slice(weights, (weights.len(), 1), r.device())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok((out, routing))
    }
}

impl std::fmt::Debug for Gemma4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gemma4")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}
