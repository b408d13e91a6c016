//! A simple per-sequence KV cache: one growing `[kv_heads, T, head_dim]`
//! pair per KV-producing layer. KV-shared layers own no entry; they read
//! their producer's.

use candle_core::Tensor;

use crate::error::Result;

/// Keys and values of one sequence.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: vec![None; num_layers], len: 0 }
    }

    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `[n, kv_heads, head_dim]` keys and values for `layer`.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let k = k.transpose(0, 1)?.contiguous()?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let entry = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        self.layers[layer] = Some(entry);
        Ok(())
    }

    /// `[kv_heads, T, head_dim]` keys and values of `layer`.
    pub(crate) fn get(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers.get(layer)?.as_ref().map(|(k, v)| (k, v))
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
