//! Key/value storage as the forward pass sees it ([`KvStore`]), and the
//! simplest implementation: one growing cache per sequence ([`KvCache`]).
//! The engine's paged cache implements the same trait.

use candle_core::Tensor;

use crate::error::{ModelError, Result};

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
