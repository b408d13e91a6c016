//! Memory planning from `config.json` alone: parameters by kind, KV bytes
//! per token per cache group, the KV footprint of a context (sliding layers
//! capped at their window) and how many tokens fit in a memory budget.

use crate::cache::SCORE_TILE;
use crate::config::{AttentionKind, KvSource, TextConfig};
use crate::paged::{kv_groups, KvDtype, KvGroup};

/// Parameter counts by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// The token embedding (tied with the output head, counted once).
    pub embedding: u64,
    /// Per-layer embeddings: the table, its projection and norm, and each layer's PLE gate/projection/norm.
    pub ple: u64,
    /// q/k/v/o projections and q/k norms of every layer.
    pub attention: u64,
    /// The dense MLP of every layer.
    pub mlp: u64,
    /// Mixture-of-experts: experts, router.
    pub experts: u64,
    /// Layer norms, final norm, layer scalars.
    pub norms: u64,
}

impl ParamCounts {
    pub fn total(&self) -> u64 {
        self.embedding + self.ple + self.attention + self.mlp + self.experts + self.norms
    }
}

/// Counts the text model's parameters (KV-shared layers' unused k/v omitted).
pub fn param_counts(cfg: &TextConfig) -> ParamCounts {
    let h = cfg.hidden_size as u64;
    let v = cfg.vocab_size as u64;
    let nh = cfg.num_attention_heads as u64;
    let n_layers = cfg.num_layers() as u64;
    let mut c = ParamCounts {
        embedding: v * h,
        norms: h,
        ..Default::default()
    };
    if cfg.ple_dim > 0 {
        let d = cfg.ple_dim as u64;
        c.ple += v * n_layers * d + n_layers * d * h + d;
        c.ple += n_layers * (2 * d * h + h);
    }
    for l in &cfg.layers {
        let hd = l.head_dim as u64;
        let kv = l.num_kv_heads as u64;
        c.attention += 2 * nh * hd * h + hd; // q, o, q_norm
        if l.kv == KvSource::Own {
            c.attention += kv * hd * h + hd; // k, k_norm
            if !l.v_is_k {
                c.attention += kv * hd * h;
            }
        }
        c.mlp += 3 * l.intermediate_size as u64 * h;
        c.norms += 4 * h + u64::from(cfg.conventions.layer_scalar);
        if let Some(m) = cfg.moe {
            let (e, i) = (m.num_experts as u64, m.intermediate_size as u64);
            c.experts += e * 3 * i * h + e * h + h + e;
            c.norms += 3 * h;
        }
    }
    c
}

/// KV bytes per token of each group in pools of `dtype`.
pub fn kv_bytes_per_token(cfg: &TextConfig, dtype: KvDtype) -> Vec<(KvGroup, usize)> {
    kv_groups(cfg)
        .into_iter()
        .map(|g| {
            let b = g.bytes_per_token(dtype);
            (g, b)
        })
        .collect()
}

/// KV bytes one sequence of `tokens` positions needs (sliding groups hold at most `window` positions).
pub fn kv_bytes_for_context(cfg: &TextConfig, tokens: usize, dtype: KvDtype) -> usize {
    kv_bytes_per_token(cfg, dtype)
        .iter()
        .map(|(g, b)| {
            let held = match g.kind {
                AttentionKind::Sliding => tokens.min(cfg.sliding_window),
                AttentionKind::Full => tokens,
            };
            b * held
        })
        .sum()
}

/// KV blocks per cache group that the engine allocates for `seqs`
/// sequences of up to `max_model_len` tokens, prefilled in chunks of at
/// most `chunk` tokens: a sliding group needs the window plus one chunk.
pub fn kv_pool_blocks(
    cfg: &TextConfig,
    max_model_len: usize,
    block_size: usize,
    chunk: usize,
    seqs: usize,
) -> Vec<(KvGroup, usize)> {
    kv_groups(cfg)
        .into_iter()
        .map(|g| {
            let per_seq =
                group_pool_blocks(g.kind, cfg.sliding_window, max_model_len, block_size, chunk);
            (g, per_seq * seqs.max(1))
        })
        .collect()
}

/// KV blocks one sequence of up to `max_model_len` tokens needs in a group
/// of `kind`, prefilled in chunks of at most `chunk` tokens.
pub fn group_pool_blocks(
    kind: AttentionKind,
    sliding_window: usize,
    max_model_len: usize,
    block_size: usize,
    chunk: usize,
) -> usize {
    let bs = block_size.max(1);
    match kind {
        AttentionKind::Sliding => {
            let span = sliding_window + chunk.max(1) - 1;
            max_model_len.div_ceil(bs).min(span.div_ceil(bs) + 1)
        }
        AttentionKind::Full => max_model_len.div_ceil(bs),
    }
}

/// What a load will keep resident, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidentEstimate {
    /// Weights every step reads (at their stored or quantized size).
    pub weights: u64,
    /// The engine's KV pools.
    pub kv: u64,
    /// Tokenizer, step activations and the process itself.
    pub runtime: u64,
    /// The media encoders (vision and audio towers), as they load.
    pub media: u64,
    /// LoRA adapters' factors, as stored.
    pub adapters: u64,
}

impl ResidentEstimate {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.runtime + self.media + self.adapters
    }
}

/// Bytes of the running process besides weights, tables and KV.
const PROCESS_BASE: u64 = 24 << 20;
/// Resident bytes of a tokenizer per vocabulary entry (measured on the
/// 262k-entry Gemma vocabularies: strings, id maps, merges).
const TOKENIZER_PER_ENTRY: u64 = 240;

/// Predicts the resident memory of serving `seqs` sequences of `ctx`
/// tokens with the weights every step reads (`weights`, as the load
/// measured them), prefilled in chunks of `chunk` tokens. By-row tables
/// add nothing: their rows are read from the file through the page cache,
/// never mapped.
pub fn resident_estimate(
    cfg: &TextConfig,
    weights: u64,
    ctx: usize,
    seqs: usize,
    chunk: usize,
    kv_dtype: KvDtype,
) -> ResidentEstimate {
    let kv: u64 = kv_pool_blocks(cfg, ctx, 16, chunk, seqs)
        .iter()
        .map(|(g, blocks)| (g.bytes_per_token(kv_dtype) * blocks * 16) as u64)
        .sum();
    // One chunk's activations, f32: the residual stream and its norms,
    // the widest MLP (gate, up, product), the per-layer inputs, and one
    // tile of attention scores of the widest layer (scores, mask,
    // probabilities; a tile is at least one query row over every key).
    let n = chunk.min(ctx).max(1) as u64;
    let widest_mlp = cfg
        .layers
        .iter()
        .map(|l| l.intermediate_size)
        .max()
        .unwrap_or(0) as u64;
    let ple = (cfg.num_layers() * cfg.ple_dim) as u64;
    let heads = cfg.num_attention_heads as u64;
    let score_tile = (heads * n * ctx as u64).min((SCORE_TILE as u64).max(heads * ctx as u64));
    let activations =
        4 * n * (8 * cfg.hidden_size as u64 + 3 * widest_mlp + 3 * ple) + 4 * 3 * score_tile;
    let logits = 4 * 3 * cfg.vocab_size as u64 * seqs as u64;
    ResidentEstimate {
        weights,
        kv,
        runtime: PROCESS_BASE + TOKENIZER_PER_ENTRY * cfg.vocab_size as u64 + activations + logits,
        media: 0,
        adapters: 0,
    }
}

/// The longest single context whose KV fits in `bytes` (capped at `limit`).
pub fn tokens_that_fit(cfg: &TextConfig, bytes: usize, dtype: KvDtype, limit: usize) -> usize {
    // kv_bytes_for_context is monotone in tokens: binary search.
    let (mut lo, mut hi) = (0usize, limit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if kv_bytes_for_context(cfg, mid, dtype) <= bytes {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn real(name: &str) -> TextConfig {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/configs")
            .join(name);
        TextConfig::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// KV bytes per token in bf16 (facts 1.3) and parameter counts (facts 1.3).
    #[test]
    fn real_configs_match_the_published_figures() {
        let cases = [
            ("gemma-4-E2B-it", 18, 4.629e9, Some(2.349e9)),
            ("gemma-4-E4B-it", 56, 7.463e9, Some(2.819e9)),
            ("gemma-4-12B-it", 336, 11.907e9, None),
            ("gemma-4-31B-it", 880, 30.697e9, None),
            ("gemma-4-26B-A4B-it", 220, 25.233e9, None),
        ];
        for (name, kib, params, ple_table) in cases {
            let cfg = real(name);
            let per_token: usize = kv_bytes_per_token(&cfg, KvDtype::Bf16)
                .iter()
                .map(|(_, b)| b)
                .sum();
            assert_eq!(per_token, kib * 1024, "{name}");
            let total = param_counts(&cfg).total() as f64;
            assert!(
                (total - params).abs() / params < 2e-3,
                "{name}: {total} vs {params}"
            );
            if let Some(t) = ple_table {
                let table = (cfg.vocab_size * cfg.num_layers() * cfg.ple_dim) as f64;
                assert!((table - t).abs() / t < 1e-3, "{name}");
            }
        }
    }

    #[test]
    fn context_bytes_cap_sliding_layers() {
        let cfg = real("gemma-4-E2B-it");
        // 4K context: sliding 12 KiB × 512 + full 6 KiB × 4096 = 30 MiB.
        assert_eq!(
            kv_bytes_for_context(&cfg, 4096, KvDtype::Bf16),
            30 * 1024 * 1024
        );
        let fit = tokens_that_fit(&cfg, 30 * 1024 * 1024, KvDtype::Bf16, 131072);
        assert_eq!(fit, 4096);
    }
}
