//! Activations rounded to 8 bits per block, the other operand of the
//! integer kernels.
//!
//! Each block of [`ActBlock`] values gets one f32 scale `d = max |x| / 127`
//! and signed bytes `q = round(x / d)`, so `x ≈ d · q`. Sums of `q` over
//! every 16 values are kept beside them: weight formats with an offset or
//! a minimum (Q4_0's −8, Q4_K's mins, Q6_K's −32) fold it in through these
//! sums instead of per value.

use std::sync::Mutex;

/// The block length a weight format's integer kernel wants its
/// activations in: 32 for ggml's small-block formats and our layouts, 256
/// for the k-quants' super-blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActBlock {
    B32,
    B256,
}

impl ActBlock {
    /// Values per block.
    pub fn values(self) -> usize {
        match self {
            ActBlock::B32 => 32,
            ActBlock::B256 => 256,
        }
    }
}

/// Values (rows × width) from which a rounding is split over the threads.
const PARALLEL_VALUES: usize = 1 << 15;

/// One thread's rows: activations in, quants, scales and sums out.
type Share<'a> = (&'a [f32], &'a mut [i8], &'a mut [f32], &'a mut [i32]);

/// `n` rows of `cols` activations rounded to 8 bits per block.
#[derive(Debug, Clone)]
pub struct QuantizedActs {
    pub block: ActBlock,
    pub n: usize,
    pub cols: usize,
    /// `[n, cols]` quants.
    pub qs: Vec<i8>,
    /// One scale per block, `[n, cols / block]`.
    pub scales: Vec<f32>,
    /// `Σ q` over every 16 values, `[n, cols / 16]`.
    pub sums: Vec<i32>,
    /// The scales of each [`crate::intdot::GROUP`] rows by block,
    /// `[n / GROUP (rounded up), cols / block, GROUP]`, 0 past row n: what a
    /// kernel that gathers a block's sums over a group of rows into one
    /// register scales them by.
    pub group_scales: Vec<f32>,
}

impl QuantizedActs {
    /// Rounds `x` (`[n, cols]`, `cols` a multiple of the block) block by block.
    pub fn quantize(x: &[f32], n: usize, cols: usize, block: ActBlock) -> Self {
        let len = block.values();
        assert!(
            cols.is_multiple_of(len) && x.len() == n * cols,
            "activations of width {cols} do not tile into blocks of {len}"
        );
        let mut qs = vec![0i8; n * cols];
        let mut scales = vec![0f32; n * cols / len];
        let mut sums = vec![0i32; n * cols / 16];
        // A prompt's activations are rounded by every thread, a share of
        // rows each (the blocks are independent, so the values are the
        // same); a decode step's few rows are not worth waking a worker.
        let pool = crate::pool::global();
        let parts = if n * cols >= PARALLEL_VALUES {
            pool.threads().min(n)
        } else {
            1
        };
        let rows = n.div_ceil(parts.max(1)).max(1);
        let shares: Vec<Mutex<Share>> = if n * cols == 0 {
            Vec::new()
        } else {
            x.chunks(rows * cols)
                .zip(qs.chunks_mut(rows * cols))
                .zip(scales.chunks_mut(rows * cols / len))
                .zip(sums.chunks_mut(rows * cols / 16))
                .map(|(((x, qs), scales), sums)| Mutex::new((x, qs, scales, sums)))
                .collect()
        };
        pool.run(shares.len(), &|i| {
            let mut share = shares[i].lock().unwrap_or_else(|e| e.into_inner());
            let (x, qs, scales, sums) = &mut *share;
            round_blocks(x, len, qs, scales, sums);
        });
        drop(shares);
        let (g, blocks) = (crate::intdot::GROUP, cols / len);
        let mut group_scales = vec![0f32; n.div_ceil(g) * blocks * g];
        for t in 0..n {
            for b in 0..blocks {
                group_scales[((t / g) * blocks + b) * g + t % g] = scales[t * blocks + b];
            }
        }
        Self {
            block,
            n,
            cols,
            qs,
            scales,
            sums,
            group_scales,
        }
    }

    /// Quants of row `t`.
    #[inline(always)]
    pub fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.cols..(t + 1) * self.cols]
    }

    /// Scale of block `b` of row `t`.
    #[inline(always)]
    pub fn scale(&self, t: usize, b: usize) -> f32 {
        self.scales[t * (self.cols / self.block.values()) + b]
    }

    /// `Σ q` of the 16-value group `g` of row `t`.
    #[inline(always)]
    pub fn sum16(&self, t: usize, g: usize) -> i32 {
        self.sums[t * (self.cols / 16) + g]
    }

    /// Row `t` widened back to f32 (`d · q`), for references in tests.
    pub fn dequantize_row(&self, t: usize) -> Vec<f32> {
        let len = self.block.values();
        self.row(t)
            .iter()
            .enumerate()
            .map(|(c, &q)| self.scale(t, c / len) * f32::from(q))
            .collect()
    }
}

#[inline(always)]
fn round_blocks_body(x: &[f32], len: usize, qs: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    for ((xb, qb), d) in x
        .chunks_exact(len)
        .zip(qs.chunks_exact_mut(len))
        .zip(scales.iter_mut())
    {
        // The largest magnitude (NaNs skipped, as `f32::max` does) in 16
        // lanes, and the cast through i32: both vectorize, where `fold(max)`
        // and a direct `as i8` ran value by value.
        let mut lanes = [0f32; 16];
        for c in xb.chunks_exact(16) {
            for (m, v) in lanes.iter_mut().zip(c) {
                let a = v.abs();
                *m = if a > *m { a } else { *m };
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            // NaN rounds to 0, as `as i8` would cast it. A select and a plain
            // conversion of a value known to fit both vectorize; the
            // saturating `as` cast ran lane by lane.
            let r = (v * inv).round();
            let r = if r.is_nan() {
                0.0
            } else {
                r.clamp(-127.0, 127.0)
            };
            // SAFETY: `r` is finite and within [-127, 127].
            *q = unsafe { r.to_int_unchecked::<i32>() } as i8;
        }
    }
    for (s, g) in sums.iter_mut().zip(qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| i32::from(q)).sum();
    }
}

crate::dispatch::multiversion!(
    /// Each block of `len` values of `x` to `qs`, its scale, and the sums
    /// of every 16 quants (compiled per instruction set: the rounding
    /// vectorizes only where the CPU rounds in SIMD).
    pub fn round_blocks(x: &[f32], len: usize, qs: &mut [i8], scales: &mut [f32], sums: &mut [i32]) => round_blocks_body
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    #[test]
    fn rounding_error_is_within_half_a_step() {
        for block in [ActBlock::B32, ActBlock::B256] {
            let x = values(3 * 512, 5, 3.0);
            let q = QuantizedActs::quantize(&x, 3, 512, block);
            for t in 0..3 {
                let back = q.dequantize_row(t);
                for (c, (&v, &w)) in x[t * 512..(t + 1) * 512].iter().zip(&back).enumerate() {
                    let d = q.scale(t, c / block.values());
                    assert!((v - w).abs() <= 0.5 * d * 1.0001, "{block:?} {t} {c}");
                }
                for g in 0..512 / 16 {
                    let want: i32 = q.row(t)[16 * g..16 * g + 16]
                        .iter()
                        .map(|&v| i32::from(v))
                        .sum();
                    assert_eq!(q.sum16(t, g), want);
                }
            }
        }
    }

    #[test]
    fn rounding_is_the_scalar_form_value_for_value() {
        // Random values, exact halves (a block whose largest value is 127,
        // so the factor is 1), and blocks with a NaN or an infinity.
        let mut x = values(4 * 256, 11, 9.0);
        x[256] = 127.0;
        for (i, v) in x[257..512].iter_mut().enumerate() {
            *v = (i % 200) as f32 - 99.5;
        }
        x[600] = f32::NAN;
        x[900] = f32::INFINITY;
        for block in [ActBlock::B32, ActBlock::B256] {
            let q = QuantizedActs::quantize(&x, 4, 256, block);
            let len = block.values();
            for (b, xb) in x.chunks_exact(len).enumerate() {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                assert_eq!(q.scales[b].to_bits(), (amax / 127.0).to_bits());
                for (c, &v) in xb.iter().enumerate() {
                    let want = (v * inv).round().clamp(-127.0, 127.0) as i8;
                    assert_eq!(q.qs[b * len + c], want, "{block:?} block {b} value {v}");
                }
            }
        }
    }

    #[test]
    fn rounding_split_over_the_pool_is_the_scalar_form() {
        // Enough values that the rows are split over the pool; every block
        // checked against the scalar definition, wherever its rows went.
        let (n, cols) = (40, 1024);
        assert!(n * cols >= PARALLEL_VALUES);
        let x = values(n * cols, 17, 4.0);
        for block in [ActBlock::B32, ActBlock::B256] {
            let len = block.values();
            let q = QuantizedActs::quantize(&x, n, cols, block);
            for (b, xb) in x.chunks_exact(len).enumerate() {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                assert_eq!(
                    q.scales[b].to_bits(),
                    (amax / 127.0).to_bits(),
                    "{block:?} {b}"
                );
                for (c, &v) in xb.iter().enumerate() {
                    let want = (v * inv).round().clamp(-127.0, 127.0) as i8;
                    assert_eq!(q.qs[b * len + c], want, "{block:?} block {b}");
                }
            }
            for (g, quants) in q.qs.chunks_exact(16).enumerate() {
                let sum: i32 = quants.iter().map(|&v| i32::from(v)).sum();
                assert_eq!(q.sums[g], sum, "{block:?} sums {g}");
            }
        }
    }

    #[test]
    fn zero_blocks_round_to_zero() {
        let q = QuantizedActs::quantize(&[0.0; 64], 1, 64, ActBlock::B32);
        assert!(q.qs.iter().all(|&v| v == 0));
        assert!(q.scales.iter().all(|&d| d == 0.0));
    }
}
