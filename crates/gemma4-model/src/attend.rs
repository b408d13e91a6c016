//! Attention read straight from a KV store's rows (`[row, kv_heads,
//! head_dim]`, f32, bf16 or int8), without gathering the context into new tensors:
//! the path of decode steps, whose few queries make batched matrix products
//! mostly overhead.

use std::ops::Range;

use crate::cache::Queries;
use crate::paged::int8_block;

/// Queries per sequence up to which attention reads the store in place;
/// longer spans (prefill) gather the keys and use batched matrix products.
pub(crate) const IN_PLACE_MAX_QUERIES: usize = 8;

/// A pool's elements, read as f32.
pub(crate) trait PoolValue: Copy {
    fn f32(self) -> f32;
}

impl PoolValue for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl PoolValue for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// `Σ q·k` with eight partial sums (vectorized by the compiler).
#[inline(always)]
fn dot<T: PoolValue>(q: &[f32], k: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let (qc, kc) = (q.chunks_exact(8), k.chunks_exact(8));
    let (q_rest, k_rest) = (qc.remainder(), kc.remainder());
    for (a, b) in qc.zip(kc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i].f32();
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (a, b) in q_rest.iter().zip(k_rest) {
        sum += a * b.f32();
    }
    sum
}

/// A pool's K or V rows, one per (slot, KV head), as attention reads them.
pub(crate) trait KvRows {
    /// `Σ q · row[r]`.
    fn dot(&self, r: usize, q: &[f32]) -> f32;
    /// `out += w · row[r]`.
    fn add_scaled(&self, r: usize, w: f32, out: &mut [f32]);
}

/// Rows stored as plain numbers.
pub(crate) struct Plain<'a, T> {
    data: &'a [T],
    head_dim: usize,
}

impl<'a, T> Plain<'a, T> {
    pub fn new(data: &'a [T], head_dim: usize) -> Self {
        Self { data, head_dim }
    }
}

impl<T: PoolValue> KvRows for Plain<'_, T> {
    #[inline(always)]
    fn dot(&self, r: usize, q: &[f32]) -> f32 {
        dot(q, &self.data[r * self.head_dim..][..self.head_dim])
    }

    #[inline(always)]
    fn add_scaled(&self, r: usize, w: f32, out: &mut [f32]) {
        let row = &self.data[r * self.head_dim..][..self.head_dim];
        for (o, &x) in out.iter_mut().zip(row) {
            *o += w * x.f32();
        }
    }
}

/// Pool bytes are int8 offset codes (`q + 128`), read as `q`.
impl PoolValue for u8 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from(self) - 128.0
    }
}

/// Rows stored as int8 offset codes with a scale per block of
/// [`int8_block`]`(head_dim)` values.
pub(crate) struct Int8Rows<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
    head_dim: usize,
    block: usize,
}

impl<'a> Int8Rows<'a> {
    pub fn new(codes: &'a [u8], scales: &'a [f32], head_dim: usize) -> Self {
        Self {
            codes,
            scales,
            head_dim,
            block: int8_block(head_dim),
        }
    }

    /// Row `r`'s blocks, each with its scale.
    #[inline(always)]
    fn blocks(&self, r: usize) -> impl Iterator<Item = (&[u8], f32)> {
        let per_row = self.head_dim / self.block;
        self.codes[r * self.head_dim..][..self.head_dim]
            .chunks_exact(self.block)
            .zip(self.scales[r * per_row..][..per_row].iter().copied())
    }
}

impl KvRows for Int8Rows<'_> {
    #[inline(always)]
    fn dot(&self, r: usize, q: &[f32]) -> f32 {
        // A loop, not `map(..).sum()`: the iterator's `fold` was compiled as
        // a function of its own, without the caller's AVX2.
        let mut sum = 0f32;
        for ((codes, scale), q) in self.blocks(r).zip(q.chunks_exact(self.block)) {
            sum += dot(q, codes) * scale;
        }
        sum
    }

    #[inline(always)]
    fn add_scaled(&self, r: usize, w: f32, out: &mut [f32]) {
        for ((codes, scale), out) in self.blocks(r).zip(out.chunks_exact_mut(self.block)) {
            let w = w * scale;
            for (o, &x) in out.iter_mut().zip(codes) {
                *o += w * x.f32();
            }
        }
    }
}

/// The shape of one in-place attention.
pub(crate) struct InPlace<'a> {
    /// Where each position from `first` on is stored (its row in the store).
    pub slots: &'a [usize],
    pub first: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl InPlace<'_> {
    /// Attention read straight from the pools `k` and `v` (`[slot, kv_heads,
    /// head_dim]`), without gathering the context. Query rows are split over
    /// the kernels' thread pool when there is enough work to pay for it.
    pub fn run<K: KvRows + Sync, V: KvRows + Sync>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
    ) -> Vec<f32> {
        let hd = self.head_dim;
        let n = q.len() / (heads * hd);
        let mut out = vec![0f32; n * heads * hd];
        // One unit is one query row of one head; units are laid out in
        // `out` in order, so a range of them is a contiguous part of it.
        let units = n * heads;
        let pool = gemma4_kernels::pool::global();
        // Multiply-adds of the whole attention (both products), roughly.
        let work = units * hd * self.slots.len() * 2;
        if pool.threads() == 1 || units < 2 || work < PARALLEL_MIN_WORK {
            self.units(k, v, q, heads, queries, 0..units, &mut out);
            return out;
        }
        let chunk = units.div_ceil(pool.threads() * 2).max(1);
        pool.for_each_chunk(&mut out, chunk * hd, &|ci, part| {
            let range = ci * chunk..((ci + 1) * chunk).min(units);
            self.units(k, v, q, heads, queries, range, part);
        });
        out
    }

    /// Units (query row `u / heads`, head `u % heads`) `units` into `out`
    /// (their `[units, head_dim]` part).
    #[allow(clippy::too_many_arguments)]
    fn units<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        units: Range<usize>,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected on this CPU.
            return unsafe { self.units_avx2(k, v, q, heads, queries, units, out) };
        }
        self.units_body(k, v, q, heads, queries, units, out)
    }

    /// [`Self::units`] compiled for AVX2 (eight lanes for the products and sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn units_avx2<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        units: Range<usize>,
        out: &mut [f32],
    ) {
        self.units_body(k, v, q, heads, queries, units, out)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn units_body<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        units: Range<usize>,
        out: &mut [f32],
    ) {
        let hd = self.head_dim;
        let group = heads / self.kv_heads;
        let end = self.first + self.slots.len();
        let first = units.start;
        let mut probs = Vec::with_capacity(self.slots.len());
        for u in units {
            let (i, h) = (u / heads, u % heads);
            let p = queries.start + i;
            let lo = queries.visibility.first_seen(p).max(self.first);
            let hi = (queries.visibility.last_seen(p) + 1).min(end);
            let kh = h / group;
            let qv = &q[u * hd..][..hd];
            let row = |slot: usize| slot * self.kv_heads + kh;
            probs.clear();
            // A loop, not `extend(map(..))`, for the same reason as in
            // `Int8Rows::dot`.
            for j in lo..hi {
                let s = self.slots[j - self.first];
                // Scaled after the product, as the batched path does.
                probs.push((k.dot(row(s), qv) as f64 * queries.scale) as f32);
            }
            let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for x in probs.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            let o = &mut out[(u - first) * hd..][..hd];
            for (j, &e) in (lo..hi).zip(&probs) {
                v.add_scaled(row(self.slots[j - self.first]), e / sum, o);
            }
        }
    }
}

/// Below this many multiply-adds an attention runs on the calling thread
/// (waking the pool costs more than it saves).
const PARALLEL_MIN_WORK: usize = 1 << 18;

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::cache::Visibility;

    fn noise(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (x >> 8) as f32 / 16_777_216.0 - 0.5
            })
            .collect()
    }

    /// Split over the pool, every (query, head) unit gives what the whole
    /// attention run on one thread gives, bit for bit.
    #[test]
    fn split_attention_equals_one_thread() {
        let (kv_heads, heads, hd, len) = (2, 8, 64, 600);
        let k = noise(len * kv_heads * hd, 1);
        let v = noise(len * kv_heads * hd, 2);
        // Slots out of order, as a block table leaves them.
        let slots: Vec<usize> = (0..len).map(|p| (p * 7) % len).collect();
        let shape = InPlace {
            slots: &slots,
            first: 0,
            kv_heads,
            head_dim: hd,
        };
        let (k, v) = (Plain::new(&k, hd), Plain::new(&v, hd));
        for (n, window) in [(1, None), (4, Some(100)), (8, None)] {
            let q = noise(n * heads * hd, 3 + n as u32);
            let qt = Tensor::from_vec(q.clone(), (n, heads, hd), &Device::Cpu).expect("q");
            let queries = Queries {
                q: &qt,
                start: len - n,
                scale: 0.125,
                visibility: Visibility::causal(window),
            };
            assert!(
                n * heads * hd * len * 2 >= PARALLEL_MIN_WORK,
                "big enough to split"
            );
            let split = shape.run(&k, &v, &q, heads, &queries);
            let mut whole = vec![0f32; n * heads * hd];
            shape.units(&k, &v, &q, heads, &queries, 0..n * heads, &mut whole);
            assert_eq!(split, whole, "n {n} window {window:?}");
            assert!(whole.iter().any(|&x| x != 0.0));
        }
    }
}
