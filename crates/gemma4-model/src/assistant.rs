//! Gemma 4's assistant: the small drafter ("multi-token prediction" head)
//! published beside each Gemma 4 size, which proposes the tokens its target
//! is likely to produce next, mirroring transformers'
//! `Gemma4AssistantForCausalLM`.
//!
//! The assistant has no embedding of its own and no K/V. Each draft step
//! reads the target's scaled embedding of the previous token joined to a
//! hidden state (first the target's last final-norm row, then the
//! assistant's own projected output), projects it down, and runs decoder
//! layers whose queries attend over the K/V of the target's two "store"
//! layers (the last layer of each attention type that computes its own
//! K/V). Every step of a round sits at the same position and sees the same
//! rows: drafted tokens are never written to any cache. The head is the
//! assistant's embedding table, in full or restricted to the tokens of the
//! best few clusters ("centroids"), with no softcap.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::cache::KvStore;
use crate::config::{AttentionKind, KvSource, LayerSpec, TextConfig};
use crate::error::{ConfigError, ModelError, Result, WeightError};
use crate::gemma4::{BatchSeq, Gemma4, LogitsFor, Mlp};
use crate::layers::{softmax_last_dim, RmsNorm, Rotary};
use crate::loader::{LoadPolicy, Weights};
use crate::safetensors_store::SafetensorsStore;
use crate::source::WeightSource;
use crate::storage::{Embedding, Linear, StoredTensor};

/// The target layers whose K/V an assistant reads: the last layer of each
/// attention type that computes its own K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLayers {
    pub sliding: usize,
    pub full: usize,
}

impl StoreLayers {
    /// The store layers of a target, if it has a K/V-producing layer of both types.
    pub fn of(cfg: &TextConfig) -> Option<Self> {
        let last = |kind: AttentionKind| {
            cfg.layers
                .iter()
                .rposition(|l| l.kind == kind && l.kv == KvSource::Own)
        };
        Some(Self {
            sliding: last(AttentionKind::Sliding)?,
            full: last(AttentionKind::Full)?,
        })
    }
}

/// Keys and values of one store layer, `[kv_heads, rows, head_dim]` in
/// f32: exactly the rows the drafter attends to.
#[derive(Debug, Clone)]
pub struct KvRows {
    pub k: Tensor,
    pub v: Tensor,
}

/// What a round of drafting reads of the target's K/V.
#[derive(Debug, Clone)]
pub struct TargetKv {
    pub sliding: KvRows,
    pub full: KvRows,
}

impl TargetKv {
    fn for_kind(&self, kind: AttentionKind) -> &KvRows {
        match kind {
            AttentionKind::Sliding => &self.sliding,
            AttentionKind::Full => &self.full,
        }
    }
}

/// One draft step's results.
#[derive(Debug, Clone)]
pub struct DraftStep {
    /// `[vocab]`; with a centroid head the tokens outside the chosen
    /// clusters hold one less than the smallest computed logit.
    pub logits: Vec<f32>,
    /// The drafted token: the first index of the largest logit.
    pub token: u32,
    /// `[target hidden]`: the hidden input of the next step.
    pub projected: Tensor,
}

enum Head {
    /// Logits for the whole vocabulary.
    Dense(Linear),
    /// Logits only for the tokens of the `top_k` clusters whose centroids
    /// score best.
    Centroids {
        centroids: Linear,
        /// `[clusters · per_cluster]`: each cluster's token ids in turn.
        ordering: Vec<u32>,
        per_cluster: usize,
        top_k: usize,
        table: Embedding,
    },
}

struct AssistantLayer {
    spec: LayerSpec,
    rotary: Rotary,
    input_norm: RmsNorm,
    post_attention_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    post_ffn_norm: RmsNorm,
    q_proj: Linear,
    q_norm: RmsNorm,
    o_proj: Linear,
    mlp: Mlp,
    layer_scalar: f64,
}

/// A loaded assistant.
pub struct Assistant {
    cfg: TextConfig,
    /// The target's hidden size, which the projections join.
    backbone_hidden: usize,
    pre_projection: Linear,
    post_projection: Linear,
    layers: Vec<AssistantLayer>,
    norm: RmsNorm,
    head: Head,
    device: Device,
}

/// The tensors of an assistant checkpoint, by their stored names.
struct RootSource(SafetensorsStore);

impl WeightSource for RootSource {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        Ok(self.0.stored(name, shape)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }

    fn total_bytes(&self) -> u64 {
        self.0.total_bytes()
    }
}

/// The assistant's settings beside its text model's.
struct HeadConfig {
    backbone_hidden: usize,
    ordered: bool,
    clusters: usize,
    top_k: usize,
}

fn read_config(dir: &Path) -> Result<(TextConfig, HeadConfig)> {
    let path = dir.join("config.json");
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Json {
        path: shown,
        message: e.to_string(),
    })?;
    let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type == "gemma4_unified_assistant" {
        return Err(ConfigError::invalid(
            "model_type",
            "the unified (12B) assistant is not supported yet; the gemma4_assistant drafters of E2B, E4B, 26B-A4B and 31B are",
        )
        .into());
    }
    if model_type != "gemma4_assistant" {
        return Err(ConfigError::invalid(
            "model_type",
            format!("`{model_type}` is not a Gemma 4 assistant (expected gemma4_assistant)"),
        )
        .into());
    }
    let number = |key: &str| json.get(key).and_then(Value::as_u64).map(|v| v as usize);
    let backbone_hidden = number("backbone_hidden_size")
        .filter(|&h| h > 0)
        .ok_or_else(|| ConfigError::missing("backbone_hidden_size"))?;
    let ordered = json
        .get("use_ordered_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (clusters, top_k) = if ordered {
        let c = number("num_centroids").ok_or_else(|| ConfigError::missing("num_centroids"))?;
        let k = number("centroid_intermediate_top_k")
            .ok_or_else(|| ConfigError::missing("centroid_intermediate_top_k"))?;
        if c == 0 || k == 0 || k > c {
            return Err(ConfigError::invalid(
                "centroid_intermediate_top_k",
                format!("must be from 1 to num_centroids ({c}), not {k}"),
            )
            .into());
        }
        (c, k)
    } else {
        (0, 0)
    };
    // Every layer reads the target's K/V; as a text model, each would own its own.
    let mut text = json
        .get("text_config")
        .cloned()
        .ok_or_else(|| ConfigError::missing("text_config"))?;
    if let Some(t) = text.as_object_mut() {
        t.insert("num_kv_shared_layers".into(), 0.into());
    }
    let cfg = TextConfig::from_hf_json(&text).map_err(|e| match e {
        ConfigError::Invalid { field, message } => ConfigError::Invalid {
            field: format!("text_config.{field}"),
            message,
        },
        other => other,
    })?;
    if cfg.moe.is_some() || cfg.ple_dim > 0 {
        return Err(ConfigError::invalid(
            "text_config",
            "an assistant with experts or per-layer embeddings is not supported",
        )
        .into());
    }
    Ok((
        cfg,
        HeadConfig {
            backbone_hidden,
            ordered,
            clusters,
            top_k,
        },
    ))
}

impl Assistant {
    /// Loads an assistant checkpoint directory (`config.json` and safetensors).
    pub fn load(dir: &Path, policy: LoadPolicy) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::Input(format!(
                "assistant directory {} does not exist",
                dir.display()
            )));
        }
        let (cfg, head_cfg) = read_config(dir)?;
        let src = RootSource(SafetensorsStore::open_dir(dir)?);
        let w = Weights::new(&src, policy);
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(Some(w.vector(name, &[dim])?), eps))
        };
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, spec) in cfg.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let (nh, hd) = (cfg.num_attention_heads, spec.head_dim);
            let scalar = w.vector(&format!("{p}layer_scalar"), &[1])?;
            layers.push(AssistantLayer {
                spec: spec.clone(),
                rotary: Rotary::new(&spec.rope),
                input_norm: norm(&format!("{p}input_layernorm.weight"), h)?,
                post_attention_norm: norm(&format!("{p}post_attention_layernorm.weight"), h)?,
                pre_ffn_norm: norm(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                post_ffn_norm: norm(&format!("{p}post_feedforward_layernorm.weight"), h)?,
                q_proj: w.linear(&format!("{p}self_attn.q_proj.weight"), nh * hd, h)?,
                q_norm: norm(&format!("{p}self_attn.q_norm.weight"), hd)?,
                o_proj: w.linear(&format!("{p}self_attn.o_proj.weight"), h, nh * hd)?,
                mlp: Mlp::load(&w, &format!("{p}mlp."), spec.intermediate_size, h)?,
                layer_scalar: f64::from(scalar.to_vec1::<f32>()?[0]),
            });
        }
        let head = load_head(&src, &w, &cfg, &head_cfg)?;
        let t = head_cfg.backbone_hidden;
        Ok(Self {
            pre_projection: w.linear("pre_projection.weight", h, 2 * t)?,
            post_projection: w.linear("post_projection.weight", t, h)?,
            norm: norm("model.norm.weight", h)?,
            backbone_hidden: t,
            cfg,
            layers,
            head,
            device: Device::Cpu,
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// Checks that this assistant drafts for `target`: the same vocabulary,
    /// a backbone of the target's width, and store layers whose K/V shapes
    /// the assistant's queries fit.
    pub fn check_target(&self, target: &TextConfig) -> Result<StoreLayers> {
        let refuse = |why: String| Err(ModelError::Input(format!("the assistant's {why}")));
        if self.backbone_hidden != target.hidden_size {
            return refuse(format!(
                "backbone_hidden_size {} is not the model's hidden_size {}",
                self.backbone_hidden, target.hidden_size
            ));
        }
        if self.cfg.vocab_size != target.vocab_size {
            return refuse(format!(
                "text_config.vocab_size {} is not the model's vocab_size {}",
                self.cfg.vocab_size, target.vocab_size
            ));
        }
        let Some(store) = StoreLayers::of(target) else {
            return refuse(
                "layers read a sliding and a full layer's K/V, and the model lacks one".into(),
            );
        };
        for (i, l) in self.layers.iter().enumerate() {
            let t = &target.layers[match l.spec.kind {
                AttentionKind::Sliding => store.sliding,
                AttentionKind::Full => store.full,
            }];
            if t.head_dim != l.spec.head_dim
                || !self.cfg.num_attention_heads.is_multiple_of(t.num_kv_heads)
            {
                let field = match l.spec.kind {
                    AttentionKind::Sliding => "head_dim",
                    AttentionKind::Full => "global_head_dim",
                };
                return refuse(format!(
                    "layer {i} ({field} {}, {} heads) cannot read the model's K/V ({field} {}, {} K/V heads)",
                    l.spec.head_dim, self.cfg.num_attention_heads, t.head_dim, t.num_kv_heads
                ));
            }
        }
        Ok(store)
    }

    /// The most rows back from the drafting position a sliding layer sees:
    /// the window and one more (as the reference's mask has it).
    pub fn sliding_reach(&self) -> usize {
        self.cfg.sliding_window + 1
    }

    /// Drafts up to `k` tokens to follow `token` at `position`, from the
    /// target's final-norm `hidden` row that predicted `token` and the
    /// target's K/V before `position`.
    pub fn draft(
        &self,
        target: &Gemma4,
        token: u32,
        hidden: &Tensor,
        position: usize,
        kv: &TargetKv,
        k: usize,
    ) -> Result<Vec<u32>> {
        let mut drafts = Vec::with_capacity(k);
        let (mut token, mut hidden) = (token, hidden.clone());
        for _ in 0..k {
            let step = self.step(target, token, &hidden, position, kv)?;
            drafts.push(step.token);
            token = step.token;
            hidden = step.projected;
        }
        Ok(drafts)
    }

    /// The `k` draft steps for a sequence whose last token the target has
    /// not run yet, with the target's state computed from scratch: one
    /// forward over the other tokens, whose store-layer rows and last
    /// final-norm row the assistant reads. Slow, and independent of any
    /// cache an engine keeps: a reference for checks.
    pub fn draft_from_scratch(
        &self,
        target: &Gemma4,
        tokens: &[u32],
        k: usize,
    ) -> Result<Vec<DraftStep>> {
        let (&last, before) = tokens
            .split_last()
            .filter(|(_, before)| !before.is_empty())
            .ok_or_else(|| ModelError::Input("drafting needs at least two tokens".into()))?;
        let store = self.check_target(target.config())?;
        let mut cache = target.new_cache();
        let seq = BatchSeq {
            ids: before,
            start: 0,
            logits: Some(LogitsFor::Last),
            soft: None,
            lora: None,
        };
        let rows = target
            .forward_batch_rows(&[seq], &mut cache, None)?
            .pop()
            .flatten()
            .ok_or_else(|| ModelError::Input("the target gave no hidden row".into()))?;
        let last_rows = |layer: usize, reach: usize| -> Result<KvRows> {
            let (k, v, _) = cache.read(layer, 0)?;
            let have = k.dim(1)?;
            let from = have.saturating_sub(reach);
            Ok(KvRows {
                k: k.narrow(1, from, have - from)?.contiguous()?,
                v: v.narrow(1, from, have - from)?.contiguous()?,
            })
        };
        let kv = TargetKv {
            sliding: last_rows(store.sliding, self.sliding_reach())?,
            full: last_rows(store.full, usize::MAX)?,
        };
        let position = before.len();
        let mut steps: Vec<DraftStep> = Vec::with_capacity(k);
        let mut hidden = rows.hidden.squeeze(0)?;
        let mut token = last;
        for _ in 0..k {
            let step = self.step(target, token, &hidden, position, &kv)?;
            token = step.token;
            hidden = step.projected.clone();
            steps.push(step);
        }
        Ok(steps)
    }

    /// One draft step from its input token and hidden row (`[target hidden]`).
    pub fn step(
        &self,
        target: &Gemma4,
        token: u32,
        hidden: &Tensor,
        position: usize,
        kv: &TargetKv,
    ) -> Result<DraftStep> {
        let embedded = target.scaled_embeddings(&[token])?;
        let hidden = hidden.reshape((1, self.backbone_hidden))?;
        let input = Tensor::cat(&[&embedded, &hidden], 1)?;
        self.step_from_input(&input, position, kv)
    }

    /// One draft step from its joined input `[1, 2 · target hidden]`.
    pub fn step_from_input(
        &self,
        input: &Tensor,
        position: usize,
        kv: &TargetKv,
    ) -> Result<DraftStep> {
        let mut x = self.pre_projection.forward(input)?;
        for layer in &self.layers {
            x = layer.forward(&x, position, kv.for_kind(layer.spec.kind), &self.device)?;
        }
        let y = self.norm.forward(&x)?;
        let logits = self.head_logits(&y)?;
        let token = first_argmax(&logits);
        let projected = self.post_projection.forward(&y)?.squeeze(0)?;
        Ok(DraftStep {
            logits,
            token,
            projected,
        })
    }

    fn head_logits(&self, y: &Tensor) -> Result<Vec<f32>> {
        match &self.head {
            Head::Dense(head) => Ok(head.forward(y)?.flatten_all()?.to_vec1::<f32>()?),
            Head::Centroids {
                centroids,
                ordering,
                per_cluster,
                top_k,
                table,
            } => {
                let scores = centroids.forward(y)?.flatten_all()?.to_vec1::<f32>()?;
                let mut best: Vec<usize> = (0..scores.len()).collect();
                // Descending, ties to the lower index, as a stable top-k gives.
                best.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                let ids: Vec<u32> = best[..*top_k]
                    .iter()
                    .flat_map(|&c| {
                        ordering[c * per_cluster..(c + 1) * per_cluster]
                            .iter()
                            .copied()
                    })
                    .collect();
                let rows = table.lookup(&ids, &self.device)?;
                let values = rows.matmul(&y.t()?)?.flatten_all()?.to_vec1::<f32>()?;
                let floor = values.iter().copied().fold(f32::INFINITY, f32::min) - 1.0;
                let mut logits = vec![floor; self.cfg.vocab_size];
                for (&id, &v) in ids.iter().zip(&values) {
                    logits[id as usize] = v;
                }
                Ok(logits)
            }
        }
    }
}

fn load_head(
    src: &RootSource,
    w: &Weights<'_>,
    cfg: &TextConfig,
    head: &HeadConfig,
) -> Result<Head> {
    let (vocab, h) = (cfg.vocab_size, cfg.hidden_size);
    if !head.ordered {
        return Ok(Head::Dense(w.linear(
            "model.embed_tokens.weight",
            vocab,
            h,
        )?));
    }
    if !vocab.is_multiple_of(head.clusters) {
        return Err(ConfigError::invalid(
            "num_centroids",
            format!(
                "{} clusters do not divide a vocabulary of {vocab}",
                head.clusters
            ),
        )
        .into());
    }
    let name = "masked_embedding.token_ordering";
    let ordering = src
        .0
        .get_raw(name, &[vocab])?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?;
    let mut seen = vec![false; vocab];
    let mut ids = Vec::with_capacity(vocab);
    for &t in &ordering {
        let fits = usize::try_from(t).ok().filter(|&t| t < vocab);
        match fits {
            Some(t) if !seen[t] => {
                seen[t] = true;
                ids.push(t as u32);
            }
            _ => {
                return Err(WeightError::Format {
                    path: name.into(),
                    message: format!("not a permutation of the {vocab} token ids (at {t})"),
                }
                .into())
            }
        }
    }
    Ok(Head::Centroids {
        centroids: w.linear("masked_embedding.centroids.weight", head.clusters, h)?,
        ordering: ids,
        per_cluster: vocab / head.clusters,
        top_k: head.top_k,
        table: w.embedding("model.embed_tokens.weight", vocab, h)?.0,
    })
}

impl AssistantLayer {
    fn forward(&self, x: &Tensor, position: usize, kv: &KvRows, device: &Device) -> Result<Tensor> {
        let a = self.attention(&self.input_norm.forward(x)?, position, kv, device)?;
        let h = (x + self.post_attention_norm.forward(&a)?)?;
        let m = self.mlp.forward(&self.pre_ffn_norm.forward(&h)?)?;
        let h = (&h + self.post_ffn_norm.forward(&m)?)?;
        Ok((h * self.layer_scalar)?)
    }

    /// One query position against the given rows, each head over its K/V
    /// head (heads grouped as the reference repeats K/V), scale 1.
    fn attention(
        &self,
        x: &Tensor,
        position: usize,
        kv: &KvRows,
        device: &Device,
    ) -> Result<Tensor> {
        let hd = self.spec.head_dim;
        let heads = self.q_proj.out_features() / hd;
        let (kv_heads, rows, kv_hd) = kv.k.dims3()?;
        if kv_hd != hd || kv_heads == 0 || !heads.is_multiple_of(kv_heads) || rows == 0 {
            return Err(ModelError::Input(format!(
                "{heads} draft heads of {hd} values cannot read {rows} K/V rows of {kv_heads} heads of {kv_hd}"
            )));
        }
        let q = self.q_proj.forward(x)?.reshape((1, heads, hd))?;
        let (cos, sin) = self.rotary.cos_sin(&[position], device)?;
        let q = Rotary::apply(&self.q_norm.forward(&q)?, &cos, &sin)?;
        let q = q.reshape((kv_heads, heads / kv_heads, hd))?;
        let scores = q.matmul(&kv.k.t()?)?;
        let out = softmax_last_dim(&scores)?.matmul(&kv.v)?;
        self.o_proj.forward(&out.reshape((1, heads * hd))?)
    }
}

/// The first index of the largest value.
fn first_argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

impl std::fmt::Debug for Assistant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assistant")
            .field("config", &self.cfg)
            .field("backbone_hidden", &self.backbone_hidden)
            .finish_non_exhaustive()
    }
}
