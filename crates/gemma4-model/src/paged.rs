//! Paged KV memory: fixed-size blocks in per-layer pools, addressed through
//! per-sequence block tables that the engine's cache manager owns.
//!
//! Only KV-producing layers get a pool (KV-shared layers read their
//! producer's). Layers are grouped by attention kind; all layers of a group
//! share block ids, and each group has its own block count, so sliding
//! layers can hold only the blocks their window still needs.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use crate::attend::{run_batch, InPlace, Int8Rows, Job, Plain, PoolValue};
use crate::cache::{attend_gathered, KvStore, Queries};
use crate::config::{AttentionKind, KvSource, TextConfig};
use crate::error::{ModelError, Result};
use crate::layers::ids_tensor;

/// Element type of the KV pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// Exact: the reference keeps K and V in f32.
    #[default]
    F32,
    /// Half the memory; K and V rounded to bf16 when written.
    Bf16,
    /// About a quarter of the memory: each head's K and V row rounded to 8
    /// bits, symmetric around 0, with a scale per block of
    /// [`INT8_BLOCK`] values (per row where the head is narrower or not a
    /// multiple of it). Stored as offset codes (`q + 128` in a byte).
    Int8,
}

impl KvDtype {
    /// Bytes of one K or V element.
    pub fn element_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
            KvDtype::Int8 => 1,
        }
    }

    /// Bytes of the scales kept beside one head's K or V row of a token.
    pub fn scale_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::Int8 => 4 * (head_dim / int8_block(head_dim)),
            KvDtype::F32 | KvDtype::Bf16 => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
        }
    }

    fn candle(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::Bf16 => DType::BF16,
            KvDtype::Int8 => DType::U8,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "bf16" => Ok(KvDtype::Bf16),
            "int8" => Ok(KvDtype::Int8),
            other => Err(format!(
                "unknown KV-cache dtype `{other}` (choose f32, bf16 or int8)"
            )),
        }
    }
}

/// Values per int8 scale in an int8 KV row (as llama.cpp's q8_0 cache).
pub const INT8_BLOCK: usize = 32;

/// Values per scale of an int8 row `head_dim` wide: [`INT8_BLOCK`], or the
/// whole row where the width is not a multiple of it.
pub fn int8_block(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(INT8_BLOCK) {
        INT8_BLOCK
    } else {
        head_dim.max(1)
    }
}

/// One cache group: the KV-producing layers of one attention kind.
#[derive(Debug, Clone, PartialEq)]
pub struct KvGroup {
    pub kind: AttentionKind,
    /// Producer layers in this group.
    pub layers: Vec<usize>,
    /// `(kv_heads, head_dim)` of each of the group's layers.
    pub heads: Vec<(usize, usize)>,
}

impl KvGroup {
    /// `Σ 2 · kv_heads · head_dim` over the group's layers: K and V elements per token.
    pub fn elements_per_token(&self) -> usize {
        self.heads
            .iter()
            .map(|&(kv_heads, hd)| 2 * kv_heads * hd)
            .sum()
    }

    /// Bytes of K and V per token in the given pool type (scales included).
    pub fn bytes_per_token(&self, dtype: KvDtype) -> usize {
        let scales: usize = self
            .heads
            .iter()
            .map(|&(kv_heads, hd)| 2 * kv_heads * dtype.scale_bytes(hd))
            .sum();
        self.elements_per_token() * dtype.element_bytes() + scales
    }
}

/// The cache groups a model needs: sliding first, then full, each only if non-empty.
pub fn kv_groups(cfg: &TextConfig) -> Vec<KvGroup> {
    [AttentionKind::Sliding, AttentionKind::Full]
        .into_iter()
        .filter_map(|kind| {
            let layers: Vec<usize> = cfg
                .layers
                .iter()
                .enumerate()
                .filter(|(_, l)| l.kind == kind && l.kv == KvSource::Own)
                .map(|(i, _)| i)
                .collect();
            let heads = layers
                .iter()
                .map(|&i| (cfg.layers[i].num_kv_heads, cfg.layers[i].head_dim))
                .collect();
            (!layers.is_empty()).then_some(KvGroup {
                kind,
                layers,
                heads,
            })
        })
        .collect()
}

/// A sequence's blocks in one group: `blocks[i]` holds logical block
/// `first_block + i` (earlier blocks were released as the window moved).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupBlocks {
    pub first_block: usize,
    pub blocks: Vec<u32>,
}

/// What one sequence of a batch may use: its block tables and its length
/// once this step's tokens are written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqBlocks {
    pub groups: Vec<GroupBlocks>,
    pub len_after_step: usize,
}

/// One producer layer's pools: K and V as `[blocks · block_size, kv_heads,
/// head_dim]`, and for int8 their scales as `[blocks · block_size, kv_heads]`.
struct LayerPool {
    group: usize,
    k: Tensor,
    v: Tensor,
    scales: Option<(Tensor, Tensor)>,
}

/// The physical pools of every producer layer.
pub struct PagedKvPool {
    block_size: usize,
    dtype: KvDtype,
    groups: Vec<KvGroup>,
    blocks_per_group: Vec<usize>,
    /// Per layer: its pools for producers, `None` otherwise.
    pools: Vec<Option<LayerPool>>,
}

impl PagedKvPool {
    /// Allocates `blocks_per_group[g]` blocks of `block_size` tokens for every group.
    pub fn new(
        cfg: &TextConfig,
        block_size: usize,
        blocks_per_group: &[usize],
        dtype: KvDtype,
        device: &Device,
    ) -> Result<Self> {
        let groups = kv_groups(cfg);
        if blocks_per_group.len() != groups.len() || block_size == 0 {
            return Err(ModelError::Input(format!(
                "paged KV needs a positive block size and one block count per group ({} groups)",
                groups.len()
            )));
        }
        let mut pools: Vec<Option<LayerPool>> = (0..cfg.num_layers()).map(|_| None).collect();
        for (g, group) in groups.iter().enumerate() {
            for &l in &group.layers {
                let spec = &cfg.layers[l];
                let slots = blocks_per_group[g] * block_size;
                let shape = (slots, spec.num_kv_heads, spec.head_dim);
                let scales = match dtype {
                    KvDtype::Int8 => {
                        let blocks = spec.head_dim / int8_block(spec.head_dim);
                        let shape = (slots, spec.num_kv_heads, blocks);
                        Some((
                            Tensor::zeros(shape, DType::F32, device)?,
                            Tensor::zeros(shape, DType::F32, device)?,
                        ))
                    }
                    KvDtype::F32 | KvDtype::Bf16 => None,
                };
                pools[l] = Some(LayerPool {
                    group: g,
                    k: Tensor::zeros(shape, dtype.candle(), device)?,
                    v: Tensor::zeros(shape, dtype.candle(), device)?,
                    scales,
                });
            }
        }
        Ok(Self {
            block_size,
            dtype,
            groups,
            blocks_per_group: blocks_per_group.to_vec(),
            pools,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    pub fn blocks_per_group(&self) -> &[usize] {
        &self.blocks_per_group
    }

    /// Bytes held by all pools.
    pub fn bytes(&self) -> usize {
        self.groups
            .iter()
            .zip(&self.blocks_per_group)
            .map(|(g, &n)| g.bytes_per_token(self.dtype) * n * self.block_size)
            .sum()
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// A [`KvStore`] over these pools for one batch.
    pub fn view<'a>(&'a mut self, batch: &'a [SeqBlocks]) -> PagedView<'a> {
        PagedView { pool: self, batch }
    }

    fn layer(&self, layer: usize) -> Result<&LayerPool> {
        self.pools
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no KV pool")))
    }
}

/// The pools plus the block tables of one batch.
pub struct PagedView<'a> {
    pool: &'a mut PagedKvPool,
    batch: &'a [SeqBlocks],
}

impl PagedView<'_> {
    fn table(&self, seq: usize, group: usize) -> Result<&GroupBlocks> {
        self.batch
            .get(seq)
            .and_then(|s| s.groups.get(group))
            .ok_or_else(|| {
                ModelError::Input(format!(
                    "sequence {seq} has no block table for group {group}"
                ))
            })
    }

    /// Pool slot of absolute position `pos`.
    fn slot(&self, t: &GroupBlocks, pos: usize) -> Result<usize> {
        let bs = self.pool.block_size;
        let logical = pos / bs;
        let block = logical
            .checked_sub(t.first_block)
            .and_then(|i| t.blocks.get(i))
            .ok_or_else(|| ModelError::Input(format!("position {pos} has no KV block")))?;
        Ok(*block as usize * bs + pos % bs)
    }
}

impl PagedView<'_> {
    /// Pool slots of the live positions of a sequence in a layer, and the first position.
    fn live_slots(&self, layer: usize, seq: usize) -> Result<(Vec<usize>, usize)> {
        let group = self.pool.layer(layer)?.group;
        let t = self.table(seq, group)?;
        let len = self.batch[seq].len_after_step;
        let first = t.first_block * self.pool.block_size;
        if len <= first {
            return Err(ModelError::Input(format!(
                "sequence {seq} has no live KV in layer {layer}"
            )));
        }
        let slots = (first..len)
            .map(|p| self.slot(t, p))
            .collect::<Result<Vec<usize>>>()?;
        Ok((slots, first))
    }
}

fn f32_data(c: &CpuStorage) -> Option<&[f32]> {
    match c {
        CpuStorage::F32(d) => Some(d),
        _ => None,
    }
}

fn bf16_data(c: &CpuStorage) -> Option<&[half::bf16]> {
    match c {
        CpuStorage::BF16(d) => Some(d),
        _ => None,
    }
}

fn u8_data(c: &CpuStorage) -> Option<&[u8]> {
    match c {
        CpuStorage::U8(d) => Some(d),
        _ => None,
    }
}

/// Rows `[n, kv_heads, head_dim]` rounded to int8 per block of
/// [`int8_block`] values: the offset codes (`q + 128`) and the scales
/// `[n, kv_heads, blocks]`, `x ≈ q · scale`.
fn quantize_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n, heads, hd) = x.dims3()?;
    let block = int8_block(hd);
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / block);
    for part in values.chunks_exact(block) {
        let max = part.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = max / 127.0;
        let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        scales.push(scale);
        codes.extend(
            part.iter()
                .map(|&x| ((x * inverse).round().clamp(-127.0, 127.0) as i32 + 128) as u8),
        );
    }
    Ok((
        Tensor::from_vec(codes, (n, heads, hd), x.device())?,
        Tensor::from_vec(scales, (n, heads, hd / block), x.device())?,
    ))
}

/// Pool rows gathered by `idx`, as f32 `[kv_heads, n, head_dim]`.
fn gather(pool: &Tensor, scales: Option<&Tensor>, idx: &Tensor) -> Result<Tensor> {
    let rows = pool.index_select(idx, 0)?.to_dtype(DType::F32)?;
    let rows = match scales {
        Some(s) => {
            let (n, heads, hd) = rows.dims3()?;
            let blocks = s.dim(2)?;
            rows.affine(1.0, -128.0)?
                .reshape((n, heads, blocks, hd / blocks))?
                .broadcast_mul(&s.index_select(idx, 0)?.unsqueeze(3)?)?
                .reshape((n, heads, hd))?
        }
        None => rows,
    };
    Ok(rows.transpose(0, 1)?.contiguous()?)
}

/// The elements of a contiguous CPU pool of type `T`, if it is one.
fn pool_slice<T: PoolValue>(
    storage: &Storage,
    offset: usize,
    pick: impl Fn(&CpuStorage) -> Option<&[T]>,
) -> Option<&[T]> {
    match storage {
        Storage::Cpu(cpu) => pick(cpu).and_then(|data| data.get(offset..)),
        _ => None,
    }
}

/// Attention of a batch's jobs read in place from a CPU pool; `None` for
/// pools it cannot read directly (another device, or a non-contiguous view).
fn attend_in_place(pool: &LayerPool, heads: usize, jobs: &[Job<'_>]) -> Option<Vec<Vec<f32>>> {
    let hd = jobs.first()?.shape.head_dim;
    let (ks, kl) = pool.k.storage_and_layout();
    let (vs, vl) = pool.v.storage_and_layout();
    if !(kl.is_contiguous() && vl.is_contiguous()) {
        return None;
    }
    let (ko, vo) = (kl.start_offset(), vl.start_offset());
    match (&pool.scales, pool.k.dtype()) {
        (None, DType::F32) => {
            let (k, v) = (
                pool_slice(&ks, ko, f32_data)?,
                pool_slice(&vs, vo, f32_data)?,
            );
            Some(run_batch(
                &Plain::new(k, hd),
                &Plain::new(v, hd),
                heads,
                jobs,
            ))
        }
        (None, DType::BF16) => {
            let (k, v) = (
                pool_slice(&ks, ko, bf16_data)?,
                pool_slice(&vs, vo, bf16_data)?,
            );
            Some(run_batch(
                &Plain::new(k, hd),
                &Plain::new(v, hd),
                heads,
                jobs,
            ))
        }
        (Some((k_scales, v_scales)), DType::U8) => {
            let (kss, ksl) = k_scales.storage_and_layout();
            let (vss, vsl) = v_scales.storage_and_layout();
            if !(ksl.is_contiguous() && vsl.is_contiguous()) {
                return None;
            }
            let k = Int8Rows::new(
                pool_slice(&ks, ko, u8_data)?,
                pool_slice(&kss, ksl.start_offset(), f32_data)?,
                hd,
            );
            let v = Int8Rows::new(
                pool_slice(&vs, vo, u8_data)?,
                pool_slice(&vss, vsl.start_offset(), f32_data)?,
                hd,
            );
            Some(run_batch(&k, &v, heads, jobs))
        }
        _ => None,
    }
}

impl KvStore for PagedView<'_> {
    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let pool = self.pool.layer(layer)?;
        let t = self.table(seq, pool.group)?;
        let n = k.dim(0)?;
        let bs = self.pool.block_size;
        let mut i = 0;
        // One copy per run of positions inside the same block.
        while i < n {
            let pos = start + i;
            let run = (bs - pos % bs).min(n - i);
            let slot = self.slot(t, pos)?;
            let (k, v) = (k.narrow(0, i, run)?, v.narrow(0, i, run)?);
            match &pool.scales {
                Some((k_scales, v_scales)) => {
                    let (kq, ks) = quantize_rows(&k)?;
                    let (vq, vs) = quantize_rows(&v)?;
                    pool.k.slice_set(&kq, 0, slot)?;
                    pool.v.slice_set(&vq, 0, slot)?;
                    k_scales.slice_set(&ks, 0, slot)?;
                    v_scales.slice_set(&vs, 0, slot)?;
                }
                None => {
                    let dt = pool.k.dtype();
                    pool.k.slice_set(&k.to_dtype(dt)?.contiguous()?, 0, slot)?;
                    pool.v.slice_set(&v.to_dtype(dt)?.contiguous()?, 0, slot)?;
                }
            }
            i += run;
        }
        Ok(())
    }

    fn read(&self, layer: usize, seq: usize) -> Result<(Tensor, Tensor, usize)> {
        let pool = self.pool.layer(layer)?;
        let (slots, first) = self.live_slots(layer, seq)?;
        let slots: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        let idx = ids_tensor(&slots, pool.k.device())?;
        let (k_scales, v_scales) = match &pool.scales {
            Some((k, v)) => (Some(k), Some(v)),
            None => (None, None),
        };
        let k = gather(&pool.k, k_scales, &idx)?;
        let v = gather(&pool.v, v_scales, &idx)?;
        Ok((k, v, first))
    }

    fn attend(&self, layer: usize, seq: usize, queries: Queries<'_>) -> Result<Tensor> {
        self.attend_batch(layer, vec![(seq, queries)])?
            .pop()
            .ok_or_else(|| ModelError::Input("no attention output".into()))
    }

    fn attend_batch(&self, layer: usize, batch: Vec<(usize, Queries<'_>)>) -> Result<Vec<Tensor>> {
        let pool = self.pool.layer(layer)?;
        let kv_heads = pool.k.dim(1)?;
        let mut outs: Vec<Option<Tensor>> = batch.iter().map(|_| None).collect();
        // Few query rows (decode steps): read in place, the whole batch in
        // one dispatch; each sequence's live slots and f32 queries first.
        let mut in_place = Vec::new();
        for (i, (seq, queries)) in batch.iter().enumerate() {
            if queries.q.dim(0)? <= crate::attend::IN_PLACE_MAX_QUERIES {
                let (slots, first) = self.live_slots(layer, *seq)?;
                let q = queries.q.flatten_all()?.to_vec1::<f32>()?;
                in_place.push((i, slots, first, q));
            }
        }
        if let Some(&(i, ..)) = in_place.first() {
            let (_, heads, hd) = batch[i].1.q.dims3()?;
            let jobs: Vec<Job<'_>> = in_place
                .iter()
                .map(|(i, slots, first, q)| Job {
                    shape: InPlace {
                        slots,
                        first: *first,
                        kv_heads,
                        head_dim: hd,
                    },
                    q,
                    queries: &batch[*i].1,
                })
                .collect();
            // `None`: not a CPU pool; those take the gathered path below.
            if let Some(results) = attend_in_place(pool, heads, &jobs) {
                for ((i, ..), out) in in_place.iter().zip(results) {
                    let n = batch[*i].1.q.dim(0)?;
                    let device = batch[*i].1.q.device();
                    outs[*i] = Some(Tensor::from_vec(out, (n, heads * hd), device)?);
                }
            }
        }
        // Prompts, and pools that cannot be read in place: gather the
        // context and use the device's matrix products.
        batch
            .into_iter()
            .zip(outs)
            .map(|((seq, queries), out)| match out {
                Some(out) => Ok(out),
                None => {
                    let (k, v, first) = self.read(layer, seq)?;
                    attend_gathered(&k, &v, first, queries)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Visibility;

    fn config() -> TextConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/oracle/e-style/config.json");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("config")).expect("json");
        TextConfig::from_hf_json(&json).expect("config")
    }

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed.wrapping_mul(40_503));
                ((x >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// int8 rows come back within half a step of their block's scale, the
    /// largest value of each block exactly, and a block of zeros as zeros.
    #[test]
    fn int8_rows_round_to_half_a_step() {
        let (n, heads, hd) = (3, 2, 64);
        let mut values = noise(n * heads * hd, 7);
        values[32..64].iter_mut().for_each(|x| *x = 0.0);
        // One large value: only its own block's scale grows.
        values[70] = 40.0;
        let x = Tensor::from_vec(values.clone(), (n, heads, hd), &Device::Cpu).expect("x");
        let (codes, scales) = quantize_rows(&x).expect("quantize");
        assert_eq!(scales.dims(), [n, heads, hd / INT8_BLOCK]);
        let codes = codes
            .flatten_all()
            .and_then(|t| t.to_vec1::<u8>())
            .expect("codes");
        let scales = scales
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("scales");
        for (b, block) in values.chunks(INT8_BLOCK).enumerate() {
            let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[b], max / 127.0);
            for (c, &v) in block.iter().enumerate() {
                let code = codes[b * INT8_BLOCK + c];
                assert!((1..=255).contains(&code), "block {b}: code {code}");
                let back = (f32::from(code) - 128.0) * scales[b];
                assert!(
                    (back - v).abs() <= scales[b] / 2.0 + 1e-7,
                    "{v} came back as {back}"
                );
                if v.abs() == max {
                    assert!(
                        (back - v).abs() <= 1e-6 * max,
                        "block maximum {v} came back as {back}"
                    );
                }
            }
        }
        assert!(codes[32..64].iter().all(|&c| c == 128) && scales[1] == 0.0);
        assert!(scales[2] > 0.3 && scales[3] < 0.01, "{scales:?}");
    }

    /// Reading the pools in place gives what gathering the context and
    /// multiplying matrices gives, for both pool types, scattered blocks,
    /// sliding windows and several queries.
    #[test]
    fn in_place_attention_matches_the_gathered_products() {
        let cfg = config();
        let bs = 4;
        let len = 23;
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Int8] {
            let groups = kv_groups(&cfg);
            let mut pool = PagedKvPool::new(&cfg, bs, &vec![12; groups.len()], dtype, &Device::Cpu)
                .expect("pool");
            // Blocks out of order, and a sliding group that dropped its first block.
            let tables: Vec<GroupBlocks> = groups
                .iter()
                .enumerate()
                .map(|(g, _)| GroupBlocks {
                    first_block: g % 2,
                    blocks: [11u32, 3, 7, 0, 9, 5][g % 2..].to_vec(),
                })
                .collect();
            let batch = vec![SeqBlocks {
                groups: tables,
                len_after_step: len,
            }];
            let mut view = pool.view(&batch);
            for (g, group) in groups.iter().enumerate() {
                let first = (g % 2) * bs;
                for &layer in &group.layers {
                    let spec = &cfg.layers[layer];
                    let (kvh, hd) = (spec.num_kv_heads, spec.head_dim);
                    let rows = len - first;
                    let k = Tensor::from_vec(
                        noise(rows * kvh * hd, 1 + layer as u32),
                        (rows, kvh, hd),
                        &Device::Cpu,
                    )
                    .expect("k");
                    let v = Tensor::from_vec(
                        noise(rows * kvh * hd, 50 + layer as u32),
                        (rows, kvh, hd),
                        &Device::Cpu,
                    )
                    .expect("v");
                    view.write(layer, 0, first, &k, &v).expect("write");
                    let heads = 4;
                    for (n, window) in [(1, None), (3, Some(5)), (8, None), (2, Some(30))] {
                        let q = Tensor::from_vec(
                            noise(n * heads * hd, 99 + n as u32),
                            (n, heads, hd),
                            &Device::Cpu,
                        )
                        .expect("q");
                        let queries = Queries {
                            q: &q,
                            start: len - n,
                            scale: 0.25,
                            visibility: Visibility::causal(window),
                        };
                        let got = view.attend(layer, 0, queries).expect("in place");
                        let (kg, vg, f) = view.read(layer, 0).expect("read");
                        let want = attend_gathered(&kg, &vg, f, queries).expect("gathered");
                        let (got, want) = (
                            got.flatten_all()
                                .and_then(|t| t.to_vec1::<f32>())
                                .expect("got"),
                            want.flatten_all()
                                .and_then(|t| t.to_vec1::<f32>())
                                .expect("want"),
                        );
                        assert_eq!(got.len(), want.len());
                        for (a, b) in got.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                                "{dtype:?} layer {layer} n {n} window {window:?}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}
