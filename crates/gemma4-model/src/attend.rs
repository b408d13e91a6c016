//! Attention read straight from a KV store's rows (`[row, kv_heads,
//! head_dim]`, f32, bf16 or int8), without gathering the context into new tensors:
//! the path of decode steps, whose few queries make batched matrix products
//! mostly overhead.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;

use crate::cache::Queries;
use crate::paged::int8_block;

/// Queries per sequence up to which attention reads the store in place;
/// longer spans (prefill) gather the keys and use batched matrix products.
/// Each query of an in-place span is computed as it would be alone, so a
/// decode step with drafted tokens up to this length gives each position
/// the bits a one-token step would.
pub const IN_PLACE_MAX_QUERIES: usize = 8;

/// A pool's elements, read as f32.
pub(crate) trait PoolValue: Copy {
    fn f32(self) -> f32;
    /// Eight elements from `p`, each as [`PoolValue::f32`] gives it.
    ///
    /// # Safety
    /// AVX2 must be present and `p..p + 8` readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl PoolValue for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl PoolValue for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // A bf16 is the high half of the f32 it stands for.
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
    }
}

/// `Σ q·k` for `H` query heads with one key, each with eight partial sums
/// (lane `i` adds the products of elements `i`, `i + 8`, …, then the lanes
/// are added in order). A head's sum takes the same steps in the same order
/// whatever `H` is and on either path (so the same bits), and the `H`
/// heads' sums are independent chains of additions, where one head alone
/// is one chain whose latency sets the pace.
#[inline(always)]
fn dots<T: PoolValue, const H: usize>(qs: [&[f32]; H], k: &[T]) -> [f32; H] {
    assert!(qs.iter().all(|q| q.len() == k.len()));
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 was detected; every query is as long as the key.
        return unsafe { dots_avx2(qs, k) };
    }
    dots_portable(qs, k)
}

/// Whether the AVX2 paths may run: the CPU has AVX2 and FMA, and
/// `GEMMA4_KERNEL_LEVEL` does not hold the kernels to portable code (both
/// paths give the same bits; the cap lets the portable one run here too).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2() -> bool {
    gemma4_kernels::level() != gemma4_kernels::Level::Portable
}

/// [`dots`] in portable code.
#[inline(always)]
fn dots_portable<T: PoolValue, const H: usize>(qs: [&[f32]; H], k: &[T]) -> [f32; H] {
    let (k8, _) = k.as_chunks::<8>();
    let mut acc = [[0f32; 8]; H];
    for (c, kc) in k8.iter().enumerate() {
        for (acc, q) in acc.iter_mut().zip(qs) {
            for i in 0..8 {
                acc[i] += q[8 * c + i] * kc[i].f32();
            }
        }
    }
    finish(acc, qs, k)
}

/// [`dots`] with AVX2: the compiler splits the portable loop's `H` sums
/// into narrow pieces, so it is written out here (multiplies and adds
/// kept apart, as the portable code has them).
///
/// # Safety
/// AVX2 must be present and every query as long as the key.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dots_avx2<T: PoolValue, const H: usize>(qs: [&[f32]; H], k: &[T]) -> [f32; H] {
    let mut acc = [_mm256_setzero_ps(); H];
    for c in (0..k.len() / 8 * 8).step_by(8) {
        let kc = T::load8(k.as_ptr().add(c));
        for (acc, q) in acc.iter_mut().zip(qs) {
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(c)), kc));
        }
    }
    let lanes = acc.map(|a| {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a);
        lanes
    });
    finish(lanes, qs, k)
}

/// The lanes of each head's partial sums added in order, then the
/// elements past the last whole eight.
#[inline(always)]
fn finish<T: PoolValue, const H: usize>(acc: [[f32; 8]; H], qs: [&[f32]; H], k: &[T]) -> [f32; H] {
    let whole = k.len() / 8 * 8;
    std::array::from_fn(|h| {
        let mut sum: f32 = acc[h].iter().sum();
        for (a, b) in qs[h][whole..].iter().zip(&k[whole..]) {
            sum += a * b.f32();
        }
        sum
    })
}

/// A pool's K or V rows, one per (slot, KV head), as attention reads them.
pub(crate) trait KvRows {
    /// `Σ q_h · row[r]` for `H` query heads at once.
    fn dots<const H: usize>(&self, r: usize, qs: [&[f32]; H]) -> [f32; H];
    /// `out += w · row[r]`.
    fn add_scaled(&self, r: usize, w: f32, out: &mut [f32]);
    /// Asks for row `r` to be brought into the caches (a hint: nothing is
    /// read, and a row past the end is ignored).
    fn prefetch(&self, r: usize);
}

/// Rows read this many positions ahead are asked for early: a decode
/// step's contexts come from beyond the caches, one 1 KiB row at a time,
/// and the products waited on each row's first load.
const PREFETCH_ROWS: usize = 4;

/// Asks for the cache lines of `bytes` (a hint that reads nothing).
#[inline(always)]
fn prefetch_bytes<T>(bytes: &[T]) {
    gemma4_kernels::prefetch(bytes.as_ptr().cast(), std::mem::size_of_val(bytes));
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
    fn dots<const H: usize>(&self, r: usize, qs: [&[f32]; H]) -> [f32; H] {
        dots(qs, &self.data[r * self.head_dim..][..self.head_dim])
    }

    #[inline(always)]
    fn add_scaled(&self, r: usize, w: f32, out: &mut [f32]) {
        let row = &self.data[r * self.head_dim..][..self.head_dim];
        for (o, &x) in out.iter_mut().zip(row) {
            *o += w * x.f32();
        }
    }

    #[inline(always)]
    fn prefetch(&self, r: usize) {
        if let Some(row) = self.data.get(r * self.head_dim..(r + 1) * self.head_dim) {
            prefetch_bytes(row);
        }
    }
}

/// Pool bytes are int8 offset codes (`q + 128`), read as `q`.
impl PoolValue for u8 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from(self) - 128.0
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        let wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
        _mm256_sub_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(128.0))
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
    fn dots<const H: usize>(&self, r: usize, qs: [&[f32]; H]) -> [f32; H] {
        // A loop, not `map(..).sum()`: the iterator's `fold` was compiled as
        // a function of its own, without the caller's AVX2.
        let mut sums = [0f32; H];
        for (b, (codes, scale)) in self.blocks(r).enumerate() {
            let at = b * self.block;
            let d = dots::<u8, H>(std::array::from_fn(|h| &qs[h][at..at + self.block]), codes);
            for (sum, d) in sums.iter_mut().zip(d) {
                *sum += d * scale;
            }
        }
        sums
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

    #[inline(always)]
    fn prefetch(&self, r: usize) {
        let per_row = self.head_dim / self.block;
        if let Some(codes) = self.codes.get(r * self.head_dim..(r + 1) * self.head_dim) {
            prefetch_bytes(codes);
        }
        if let Some(scales) = self.scales.get(r * per_row..(r + 1) * per_row) {
            prefetch_bytes(scales);
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

/// One sequence's share of a batched in-place attention: where its
/// positions are stored, its rotated queries (`[n, heads, head_dim]`) and
/// what they see.
pub(crate) struct Job<'a> {
    pub shape: InPlace<'a>,
    pub q: &'a [f32],
    pub queries: &'a Queries<'a>,
}

/// Attention of every job read straight from the pools `k` and `v`
/// (`[slot, kv_heads, head_dim]`, one layer's, so the jobs share `heads`,
/// `kv_heads` and `head_dim`), without gathering any context: one output
/// `[n, heads · head_dim]` per job. Query heads that share a KV head read
/// each key and value row together; the batch's sequences go to the
/// kernels' thread pool in one dispatch when there is enough work to pay
/// for it, so each thread reads a sequence's rows once for all its heads.
/// A head's result takes the same steps whatever it is batched with.
pub(crate) fn run_batch<K: KvRows + Sync, V: KvRows + Sync>(
    k: &K,
    v: &V,
    heads: usize,
    jobs: &[Job<'_>],
) -> Vec<Vec<f32>> {
    let Some(first) = jobs.first() else {
        return Vec::new();
    };
    let (hd, kv_heads) = (first.shape.head_dim, first.shape.kv_heads);
    let rows: usize = jobs.iter().map(|j| j.q.len() / (heads * hd)).sum();
    // Multiply-adds of the whole attention (both products), roughly.
    let work: usize = jobs
        .iter()
        .map(|j| j.q.len() * j.shape.slots.len() * 2)
        .sum();
    let pool = gemma4_kernels::pool::global();
    let threads = if work < PARALLEL_MIN_WORK {
        1
    } else {
        pool.threads()
    };
    // Heads read together: as many of a KV head's as divide its group, up
    // to eight, leaving a unit of work for every thread.
    let group = heads / kv_heads;
    let together = [8, 4, 2]
        .into_iter()
        .find(|&h| group.is_multiple_of(h) && rows * heads / h >= threads)
        .unwrap_or(1);
    match together {
        8 => split::<K, V, 8>(k, v, heads, jobs, threads),
        4 => split::<K, V, 4>(k, v, heads, jobs, threads),
        2 => split::<K, V, 2>(k, v, heads, jobs, threads),
        _ => split::<K, V, 1>(k, v, heads, jobs, threads),
    }
}

/// [`InPlace::units`] over every unit of `H` heads of every job, split
/// over `threads` of the pool.
fn split<K: KvRows + Sync, V: KvRows + Sync, const H: usize>(
    k: &K,
    v: &V,
    heads: usize,
    jobs: &[Job<'_>],
    threads: usize,
) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|j| vec![0f32; j.q.len()]).collect();
    // One unit is `H` heads of one query row; a job's units are laid out in
    // its output in order, so a range of them is a contiguous part of it.
    let unit = H * jobs.first().map_or(1, |j| j.shape.head_dim);
    let run = |j: &Job<'_>, units: Range<usize>, out: &mut [f32]| {
        j.shape
            .units::<K, V, H>(k, v, j.q, heads, j.queries, units, out)
    };
    if threads == 1 {
        for (j, out) in jobs.iter().zip(&mut outs) {
            run(j, 0..out.len() / unit, out);
        }
        return outs;
    }
    let total: usize = outs.iter().map(|o| o.len() / unit).sum();
    let chunk = total.div_ceil(threads * 2).max(1);
    // Each part: (job, its first unit) and where its units go.
    let mut owners = Vec::new();
    let mut parts = Vec::new();
    for (ji, out) in outs.iter_mut().enumerate() {
        for (ci, part) in out.chunks_mut(chunk * unit).enumerate() {
            owners.push((ji, ci * chunk));
            parts.push(part);
        }
    }
    gemma4_kernels::pool::global().for_each_part(parts, &|p, part| {
        let (ji, u0) = owners[p];
        run(&jobs[ji], u0..u0 + part.len() / unit, part);
    });
    outs
}

impl InPlace<'_> {
    /// Units (query row `u / (heads / H)`, heads `H · (u % (heads / H))..`)
    /// `units` into `out` (their `[units, H, head_dim]` part).
    #[allow(clippy::too_many_arguments)]
    fn units<K: KvRows, V: KvRows, const H: usize>(
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
        if avx2() {
            // SAFETY: the features were detected on this CPU.
            return unsafe { self.units_avx2::<K, V, H>(k, v, q, heads, queries, units, out) };
        }
        self.units_body::<K, V, H>(k, v, q, heads, queries, units, out)
    }

    /// [`Self::units`] compiled for AVX2 (eight lanes for the products and sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn units_avx2<K: KvRows, V: KvRows, const H: usize>(
        &self,
        k: &K,
        v: &V,
        q: &[f32],
        heads: usize,
        queries: &Queries<'_>,
        units: Range<usize>,
        out: &mut [f32],
    ) {
        self.units_body::<K, V, H>(k, v, q, heads, queries, units, out)
    }

    /// Each head's scores, softmax and weighted sum of values take the same
    /// steps in the same order whatever `H` is: only the loads are shared.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn units_body<K: KvRows, V: KvRows, const H: usize>(
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
        let per_row = heads / H;
        let end = self.first + self.slots.len();
        let first = units.start;
        let mut probs: [Vec<f32>; H] =
            std::array::from_fn(|_| Vec::with_capacity(self.slots.len()));
        for u in units {
            let (i, h0) = (u / per_row, H * (u % per_row));
            let p = queries.start + i;
            let lo = queries.visibility.first_seen(p).max(self.first);
            let hi = (queries.visibility.last_seen(p) + 1).min(end);
            let kh = h0 / group;
            let qs: [&[f32]; H] = std::array::from_fn(|h| &q[(i * heads + h0 + h) * hd..][..hd]);
            let row = |slot: usize| slot * self.kv_heads + kh;
            probs.iter_mut().for_each(Vec::clear);
            // A loop, not `extend(map(..))`, for the same reason as in
            // `Int8Rows::dots`.
            for j in lo..hi {
                // Both rows of a later position: the values are read after
                // every key, and all of them stay in the caches till then.
                if let Some(&ahead) = self.slots.get(j + PREFETCH_ROWS - self.first) {
                    if j + PREFETCH_ROWS < hi {
                        k.prefetch(row(ahead));
                        v.prefetch(row(ahead));
                    }
                }
                let s = self.slots[j - self.first];
                let scores = k.dots(row(s), qs);
                for (probs, score) in probs.iter_mut().zip(scores) {
                    // Scaled after the product, as the batched path does.
                    probs.push((score as f64 * queries.scale) as f32);
                }
            }
            let mut sums = [0f32; H];
            for (probs, sum) in probs.iter_mut().zip(&mut sums) {
                let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for x in probs.iter_mut() {
                    *x = (*x - max).exp();
                    *sum += *x;
                }
            }
            let o = &mut out[(u - first) * H * hd..][..H * hd];
            for (at, j) in (lo..hi).enumerate() {
                let r = row(self.slots[j - self.first]);
                for (h, o) in o.chunks_exact_mut(hd).enumerate() {
                    v.add_scaled(r, probs[h][at] / sums[h], o);
                }
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

    /// The AVX2 products give the portable code's bits, for every pool
    /// type, with and without elements past the last whole eight.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_products_equal_the_portable_ones() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        fn check<T: PoolValue>(k: &[T], what: &str) {
            let q = noise(4 * k.len(), 5);
            let qs: [&[f32]; 4] = std::array::from_fn(|h| &q[h * k.len()..][..k.len()]);
            // SAFETY: AVX2 was detected; the queries are as long as the key.
            let fast = unsafe { dots_avx2(qs, k) };
            assert_eq!(fast, dots_portable(qs, k), "{what} len {}", k.len());
            assert_eq!(fast[1..2], dots_portable([qs[1]], k), "{what} one head");
        }
        for len in [256, 37] {
            let k = noise(len, 6);
            check(&k, "f32");
            let kb: Vec<half::bf16> = k.iter().map(|&x| half::bf16::from_f32(x)).collect();
            check(&kb, "bf16");
            let kc: Vec<u8> = k.iter().map(|&x| (x * 250.0 + 128.0) as u8).collect();
            check(&kc, "int8");
        }
    }

    /// Read with the heads of a KV head together and split over the pool,
    /// alone or in a batch of sequences of other lengths and windows, every
    /// head gives what it gives alone on one thread, bit for bit, for f32,
    /// bf16 and int8 rows.
    #[test]
    fn grouped_split_attention_equals_one_head_at_a_time() {
        let (kv_heads, hd, len) = (2, 128, 600);
        let k = noise(len * kv_heads * hd, 1);
        let v = noise(len * kv_heads * hd, 2);
        let bf16 = |x: &[f32]| {
            x.iter()
                .map(|&x| half::bf16::from_f32(x))
                .collect::<Vec<_>>()
        };
        let (kb, vb) = (bf16(&k), bf16(&v));
        let codes = |x: &[f32]| {
            x.iter()
                .map(|&x| (x * 250.0 + 128.0) as u8)
                .collect::<Vec<_>>()
        };
        let (kc, vc) = (codes(&k), codes(&v));
        let scales = noise(len * kv_heads * hd / int8_block(hd), 9);
        // Slots out of order, as a block table leaves them.
        let slots: Vec<usize> = (0..len).map(|p| (p * 7) % len).collect();
        let shape = InPlace {
            slots: &slots,
            first: 0,
            kv_heads,
            head_dim: hd,
        };
        fn check<K: KvRows + Sync, V: KvRows + Sync>(
            shape: &InPlace<'_>,
            k: &K,
            v: &V,
            what: &str,
        ) {
            let hd = shape.head_dim;
            // A shorter sequence beside the full one: its first 300 positions.
            let short = InPlace {
                slots: &shape.slots[..300],
                ..*shape
            };
            // Groups of 1, 2, 4 and 8 query heads per KV head.
            for heads in [2, 4, 8, 16] {
                let cases = [(shape, 1, None), (&short, 4, Some(100)), (shape, 8, None)];
                let qs: Vec<Vec<f32>> = cases
                    .iter()
                    .map(|&(_, n, _)| noise(n * heads * hd, 3 + n as u32))
                    .collect();
                let qts: Vec<Tensor> = cases
                    .iter()
                    .zip(&qs)
                    .map(|(&(_, n, _), q)| {
                        Tensor::from_vec(q.clone(), (n, heads, hd), &Device::Cpu).expect("q")
                    })
                    .collect();
                let queries: Vec<Queries<'_>> = cases
                    .iter()
                    .zip(&qts)
                    .map(|(&(shape, n, window), qt)| Queries {
                        q: qt,
                        start: shape.slots.len() - n,
                        scale: 0.125,
                        visibility: Visibility::causal(window),
                    })
                    .collect();
                let jobs: Vec<Job<'_>> = cases
                    .iter()
                    .zip(qs.iter().zip(&queries))
                    .map(|(&(shape, ..), (q, queries))| Job {
                        shape: InPlace { ..*shape },
                        q,
                        queries,
                    })
                    .collect();
                let batched = run_batch(k, v, heads, &jobs);
                for (i, job) in jobs.iter().enumerate() {
                    let (n, window) = (cases[i].1, cases[i].2);
                    assert!(
                        n * heads * hd * job.shape.slots.len() * 2 >= PARALLEL_MIN_WORK,
                        "big enough to split"
                    );
                    let split = run_batch(k, v, heads, std::slice::from_ref(job));
                    let mut alone = vec![0f32; n * heads * hd];
                    job.shape.units::<K, V, 1>(
                        k,
                        v,
                        job.q,
                        heads,
                        job.queries,
                        0..n * heads,
                        &mut alone,
                    );
                    assert_eq!(
                        split[0], alone,
                        "{what}: heads {heads} n {n} window {window:?} alone"
                    );
                    assert_eq!(
                        batched[i], alone,
                        "{what}: heads {heads} n {n} window {window:?} in a batch"
                    );
                    assert!(alone.iter().any(|&x| x != 0.0));
                }
            }
        }
        check(&shape, &Plain::new(&k, hd), &Plain::new(&v, hd), "f32");
        check(&shape, &Plain::new(&kb, hd), &Plain::new(&vb, hd), "bf16");
        let (ki, vi) = (
            Int8Rows::new(&kc, &scales, hd),
            Int8Rows::new(&vc, &scales, hd),
        );
        check(&shape, &ki, &vi, "int8");
    }
}
