//! Key/value storage as the forward pass sees it ([`KvStore`]), and the
//! simplest implementation: one growing cache per sequence ([`KvCache`]).
//! The engine's paged cache implements the same trait.

use candle_core::Tensor;

use crate::error::{ModelError, Result};
use crate::layers::softmax_last_dim;

/// Which keys a query sees: a query at position p sees key j iff j ≤ p and,
/// with a sliding window w, j > p − w.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Visibility<'a> {
    pub window: Option<usize>,
    /// `[start, end)` runs of positions that see each other whole (one
    /// image's soft tokens, on models with bidirectional image attention),
    /// ascending; empty for plain causal attention.
    pub blocks: &'a [(usize, usize)],
    /// A query sees all of its block even past its window (the 12B's masks);
    /// otherwise the window still bounds it.
    pub blocks_escape_window: bool,
}

impl Visibility<'_> {
    /// Causal attention, limited to `window` keys when given.
    pub fn causal(window: Option<usize>) -> Self {
        Visibility {
            window,
            blocks: &[],
            blocks_escape_window: false,
        }
    }

    fn block_of(self, p: usize) -> Option<(usize, usize)> {
        let i = self.blocks.partition_point(|&(_, end)| end <= p);
        self.blocks.get(i).copied().filter(|&(start, _)| start <= p)
    }

    /// The first position a query at `p` sees.
    pub fn first_seen(self, p: usize) -> usize {
        let window_start = self.window.map_or(0, |w| (p + 1).saturating_sub(w));
        match self.block_of(p) {
            Some((start, _)) if self.blocks_escape_window => window_start.min(start),
            _ => window_start,
        }
    }

    /// The last position a query at `p` sees: itself, or the end of its block.
    pub fn last_seen(self, p: usize) -> usize {
        self.block_of(p).map_or(p, |(_, end)| end - 1)
    }
}

/// One sequence's queries for [`KvStore::attend`].
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    /// `[n, heads, head_dim]`, rotated.
    pub q: &'a Tensor,
    /// Absolute position of the first query.
    pub start: usize,
    pub scale: f64,
    pub visibility: Visibility<'a>,
}

/// Storage for the keys and values of the sequences in a batch.
///
/// `seq` indexes the batch passed to [`crate::Gemma4::forward_batch`];
/// `layer` is always a KV-producing layer (shared layers read their producer's).
pub trait KvStore {
    /// Stores `[n, kv_heads, head_dim]` keys and values for positions `start..start + n`.
    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()>;
    /// `[kv_heads, T, head_dim]` keys and values and the position of the first one.
    /// Positions are contiguous; a store may drop positions no query can see.
    fn read(&self, layer: usize, seq: usize) -> Result<(Tensor, Tensor, usize)>;

    /// `[n, heads · head_dim]`: softmax(scale · q·kᵀ over the visible keys) · v
    /// for one sequence's queries against the keys and values of `layer`.
    fn attend(&self, layer: usize, seq: usize, queries: Queries<'_>) -> Result<Tensor> {
        let (k, v, first) = self.read(layer, seq)?;
        attend_gathered(&k, &v, first, queries)
    }

    /// [`KvStore::attend`] for several sequences of one layer at once
    /// (`(seq, queries)` pairs), the outputs in the same order. A store
    /// may share work across the batch; each output is what `attend` gives.
    fn attend_batch(&self, layer: usize, batch: Vec<(usize, Queries<'_>)>) -> Result<Vec<Tensor>> {
        batch
            .into_iter()
            .map(|(seq, queries)| self.attend(layer, seq, queries))
            .collect()
    }
}

/// Score elements (query rows × keys, every head) one tile of
/// [`attend_gathered`] holds at once, so its memory stays bounded at any
/// context length: 2 MiB of f32 per score tensor.
pub const SCORE_TILE: usize = 1 << 19;

/// Attention over gathered `[kv_heads, T, head_dim]` keys and values whose
/// first position is `first`, as batched matrix products over tiles of
/// query rows; each tile multiplies only the keys its rows can see.
pub fn attend_gathered(
    k: &Tensor,
    v: &Tensor,
    first: usize,
    queries: Queries<'_>,
) -> Result<Tensor> {
    let (n, heads, hd) = queries.q.dims3()?;
    let total = k.dim(1)?;
    let mut rows = (SCORE_TILE / (heads * total).max(1)).clamp(1, n.max(1));
    // With a prompt's worth of work, four tiles per thread of the kernels'
    // pool: the tiles run side by side (candle's products in them run on
    // the calling thread), and as later rows see more keys, several per
    // thread even out their shares.
    let pool = gemma4_kernels::pool::global();
    if pool.threads() > 1 && n * total * heads * hd >= PARALLEL_MIN_WORK {
        rows = rows.min(n.div_ceil(4 * pool.threads()));
    }
    if rows >= n {
        return attend_tile(k, v, first, queries);
    }
    let mut tiles = Vec::with_capacity(n.div_ceil(rows));
    for at in (0..n).step_by(rows) {
        let len = rows.min(n - at);
        let start = queries.start + at;
        // From the earliest key any row sees to the last row (or the end of
        // its block).
        let vis = queries.visibility;
        let lo = (start..start + len)
            .map(|p| vis.first_seen(p))
            .min()
            .unwrap_or(start)
            .max(first);
        let hi = (queries.visibility.last_seen(start + len - 1) + 1).min(first + total);
        if hi <= lo {
            return Err(ModelError::Input(format!(
                "queries at {start}..{} see no stored key ({first}..{})",
                start + len,
                first + total
            )));
        }
        tiles.push((at, len, start, lo, hi));
    }
    let outs = pool
        .map(tiles.len(), &|i| {
            let (at, len, start, lo, hi) = tiles[i];
            let q = queries.q.narrow(0, at, len)?;
            let tile = Queries {
                q: &q,
                start,
                ..queries
            };
            let (k, v) = (
                k.narrow(1, lo - first, hi - lo)?,
                v.narrow(1, lo - first, hi - lo)?,
            );
            attend_tile(&k, &v, lo, tile)
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&outs, 0)?)
}

/// Multiply-adds (query rows × keys × heads × head_dim) from which
/// [`attend_gathered`] splits its rows over the kernels' threads.
const PARALLEL_MIN_WORK: usize = 1 << 22;

/// One tile of [`attend_gathered`]: all of `queries` against all of `k`, `v`.
fn attend_tile(k: &Tensor, v: &Tensor, first: usize, queries: Queries<'_>) -> Result<Tensor> {
    let (n, heads, hd) = queries.q.dims3()?;
    let kvh = k.dim(0)?;
    let total = k.dim(1)?;
    let group = heads / kvh;
    // Group query heads by their KV head: [kv, group · n, hd].
    let q = queries
        .q
        .transpose(0, 1)?
        .reshape((kvh, group * n, hd))?
        .contiguous()?;
    let mut scores = q.matmul(&k.t()?)?;
    if queries.scale != 1.0 {
        scores = (scores * queries.scale)?;
    }
    let mut mask = Vec::with_capacity(n * total);
    for p in queries.start..queries.start + n {
        let (seen, last) = (
            queries.visibility.first_seen(p),
            queries.visibility.last_seen(p),
        );
        for j in first..first + total {
            let visible = j <= last && j >= seen;
            mask.push(if visible { 0.0f32 } else { f32::NEG_INFINITY });
        }
    }
    let mask = Tensor::from_vec(mask, (n, total), q.device())?;
    let scores = scores
        .reshape((kvh, group, n, total))?
        .broadcast_add(&mask)?;
    let probs = softmax_last_dim(&scores)?.reshape((kvh, group * n, total))?;
    let out = probs.matmul(v)?; // [kv, group · n, hd]
    Ok(out
        .reshape((heads, n, hd))?
        .transpose(0, 1)?
        .reshape((n, heads * hd))?)
}

/// Keys and values of one sequence, kept whole.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
        }
    }

    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Bytes of K/V held (f32), for reporting.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * 4)
            .sum()
    }
}

impl KvStore for KvCache {
    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        if seq != 0 {
            return Err(ModelError::Input(
                "a KvCache holds exactly one sequence".into(),
            ));
        }
        let held = self.layers[layer]
            .as_ref()
            .map_or(Ok(0), |(k, _)| k.dim(1))?;
        if held != start {
            return Err(ModelError::Input(format!(
                "cache of layer {layer} holds {held} positions, write starts at {start}"
            )));
        }
        let k = k.transpose(0, 1)?.contiguous()?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let entry = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        self.layers[layer] = Some(entry);
        Ok(())
    }

    fn read(&self, layer: usize, _seq: usize) -> Result<(Tensor, Tensor, usize)> {
        match self.layers.get(layer).and_then(Option::as_ref) {
            Some((k, v)) => Ok((k.clone(), v.clone(), 0)),
            None => Err(ModelError::Input(format!(
                "no K/V stored for layer {layer}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_block_sees_itself_whole_and_nothing_else_changes() {
        let blocks = [(10, 13), (20, 21)];
        let v = Visibility {
            window: Some(4),
            blocks: &blocks,
            blocks_escape_window: false,
        };
        assert_eq!(
            (9..22).map(|p| v.last_seen(p)).collect::<Vec<_>>(),
            [9, 12, 12, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
        );
        assert_eq!(v.first_seen(12), 9);
        assert_eq!(Visibility::causal(None).last_seen(11), 11);
        // Past the window: the whole block, from its start.
        let escaping = Visibility {
            blocks_escape_window: true,
            ..v
        };
        assert_eq!(escaping.first_seen(12), 9);
        let long = [(10, 30)];
        let escaping = Visibility {
            blocks: &long,
            ..escaping
        };
        assert_eq!((escaping.first_seen(25), escaping.last_seen(25)), (10, 29));
        assert_eq!(escaping.first_seen(31), 28);
    }

    /// Tiles over query rows, each multiplying only the keys its rows can
    /// see, give what one product over every query and key gives.
    #[test]
    fn tiled_attention_equals_one_product_over_everything() {
        let dev = Device::Cpu;
        let (heads, kv_heads, hd) = (4, 2, 16);
        // Blocks: runs of positions that see each other whole.
        let blocks = [(100, 163), (400, 466)];
        for (window, first, total, n, blocks, escape) in [
            (None, 0, 700, 700, &[][..], false),
            (None, 0, 1500, 300, &[], false),
            (Some(64), 0, 900, 900, &[], false),
            (Some(200), 1000, 800, 500, &[], false),
            (Some(64), 0, 900, 900, &blocks[..], false),
            (Some(16), 0, 900, 900, &blocks[..], true),
        ] {
            let k = Tensor::randn(0f32, 1.0, (kv_heads, total, hd), &dev).expect("k");
            let v = Tensor::randn(0f32, 1.0, (kv_heads, total, hd), &dev).expect("v");
            let q = Tensor::randn(0f32, 1.0, (n, heads, hd), &dev).expect("q");
            let queries = Queries {
                q: &q,
                start: first + total - n,
                scale: 0.25,
                visibility: Visibility {
                    window,
                    blocks,
                    blocks_escape_window: escape,
                },
            };
            assert!(
                SCORE_TILE / (heads * total) < n,
                "the case must be split into tiles"
            );
            let tiled = attend_gathered(&k, &v, first, queries).expect("tiled");
            let whole = attend_tile(&k, &v, first, queries).expect("whole");
            let diff = (tiled - whole)
                .expect("sub")
                .abs()
                .expect("abs")
                .max_all()
                .expect("max")
                .to_scalar::<f32>()
                .expect("scalar");
            assert!(diff < 1e-5, "window {window:?}, {n} queries: {diff}");
        }
    }
}
