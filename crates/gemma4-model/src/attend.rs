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
        self.blocks(r)
            .zip(q.chunks_exact(self.block))
            .map(|((codes, scale), q)| dot(q, codes) * scale)
            .sum()
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
        let width = heads * hd;
        let mut out = vec![0f32; n * width];
        let pool = gemma4_kernels::pool::global();
        // Multiply-adds of the whole attention (both products), roughly.
        let work = n * width * self.slots.len() * 2;
        if pool.threads() == 1 || n < 2 || work < PARALLEL_MIN_WORK {
            self.rows(k, v, q, heads, queries, 0..n, &mut out);
            return out;
        }
        let chunk = n.div_ceil(pool.threads() * 4).max(1);
        let parts: Vec<std::sync::Mutex<&mut [f32]>> = out
            .chunks_mut(chunk * width)
            .map(std::sync::Mutex::new)
            .collect();
        pool.run(parts.len(), &|ci| {
            let rows = ci * chunk..((ci + 1) * chunk).min(n);
            let mut part = parts[ci].lock().unwrap_or_else(|e| e.into_inner());
            self.rows(k, v, q, heads, queries, rows, &mut part);
        });
        drop(parts);
        out
    }

    /// Query rows `rows` into `out` (their `[rows, heads · head_dim]` part).
    #[allow(clippy::too_many_arguments)]
    fn rows<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected on this CPU.
            return unsafe { self.rows_avx2(k, v, q, heads, queries, rows, out) };
        }
        self.rows_body(k, v, q, heads, queries, rows, out)
    }

    /// [`Self::rows`] compiled for AVX2 (eight lanes for the products and sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_avx2<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        self.rows_body(k, v, q, heads, queries, rows, out)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn rows_body<K: KvRows, V: KvRows>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let hd = self.head_dim;
        let group = heads / self.kv_heads;
        let end = self.first + self.slots.len();
        let first_row = rows.start;
        let mut probs = Vec::with_capacity(self.slots.len());
        for i in rows {
            let p = queries.start + i;
            let lo = queries.visibility.first_seen(p).max(self.first);
            let hi = (queries.visibility.last_seen(p) + 1).min(end);
            for h in 0..heads {
                let kh = h / group;
                let qv = &q[(i * heads + h) * hd..][..hd];
                let row = |slot: usize| slot * self.kv_heads + kh;
                probs.clear();
                probs.extend((lo..hi).map(|j| {
                    let s = self.slots[j - self.first];
                    // Scaled after the product, as the batched path does.
                    (k.dot(row(s), qv) as f64 * queries.scale) as f32
                }));
                let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in probs.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let o = &mut out[((i - first_row) * heads + h) * hd..][..hd];
                for (j, &e) in (lo..hi).zip(&probs) {
                    v.add_scaled(row(self.slots[j - self.first]), e / sum, o);
                }
            }
        }
    }
}

/// Below this many multiply-adds an attention runs on the calling thread
/// (waking the pool costs more than it saves).
const PARALLEL_MIN_WORK: usize = 1 << 18;
