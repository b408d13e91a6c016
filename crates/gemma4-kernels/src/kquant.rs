//! GGUF k-quants (Q4_K, Q5_K, Q6_K: 256-value super-blocks) read in place:
//! each super-block is decoded into a register-sized buffer and multiplied
//! with f32 activations at once.

use std::marker::PhantomData;
use std::ops::Range;

use crate::dispatch::multiversion;
use crate::intdot::{matrix_k, KindK};
use crate::{f16_to_f32, ActBlock, Bytes, IntegerDots, QuantizedActs, WeightMatrix};

/// Values per super-block.
pub const SUPER: usize = 256;

/// One super-block layout.
pub trait SuperBlock: Send + Sync + std::fmt::Debug + 'static {
    const NAME: &'static str;
    /// The super-block as the integer kernels decode it.
    const KIND: KindK;
    const BYTES: usize = crate::intdot::k_bytes(Self::KIND);
    fn decode(block: &[u8], out: &mut [f32; SUPER]);
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed 6-bit bytes.
#[inline(always)]
fn scale_min(j: usize, q: &[u8]) -> (f32, f32) {
    let (d, m) = crate::intdot::scale_min(j, q);
    (d as f32, m as f32)
}

/// `d`, `dmin` (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
#[derive(Debug)]
pub struct Q4K;
impl SuperBlock for Q4K {
    const NAME: &'static str = "Q4_K";
    const KIND: KindK = KindK::Q4K;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; SUPER]) {
        let (d, dmin) = (half(b, 0), half(b, 2));
        let scales = &b[4..16];
        let qs = &b[16..144];
        for j in 0..4 {
            let (s1, m1) = scale_min(2 * j, scales);
            let (s2, m2) = scale_min(2 * j + 1, scales);
            let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
            let q = &qs[32 * j..32 * j + 32];
            let o = &mut out[64 * j..64 * j + 64];
            for l in 0..32 {
                o[l] = d1 * f32::from(q[l] & 0xF) - m1;
                o[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
            }
        }
    }
}

/// `d`, `dmin` (f16), 12 bytes of scales and mins, 32 bytes of fifth bits, 128 of nibbles.
#[derive(Debug)]
pub struct Q5K;
impl SuperBlock for Q5K {
    const NAME: &'static str = "Q5_K";
    const KIND: KindK = KindK::Q5K;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; SUPER]) {
        let (d, dmin) = (half(b, 0), half(b, 2));
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[48..176];
        for j in 0..4 {
            let (s1, m1) = scale_min(2 * j, scales);
            let (s2, m2) = scale_min(2 * j + 1, scales);
            let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            let q = &qs[32 * j..32 * j + 32];
            let o = &mut out[64 * j..64 * j + 64];
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                o[l] = d1 * f32::from((q[l] & 0xF) + h1) - m1;
                o[l + 32] = d2 * f32::from((q[l] >> 4) + h2) - m2;
            }
        }
    }
}

/// 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, `d` (f16).
#[derive(Debug)]
pub struct Q6K;
impl SuperBlock for Q6K {
    const NAME: &'static str = "Q6_K";
    const KIND: KindK = KindK::Q6K;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; SUPER]) {
        let d = half(b, 208);
        for n in 0..2 {
            let ql = &b[64 * n..64 * n + 64];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            let sc = &b[192 + 8 * n..192 + 8 * n + 8];
            let o = &mut out[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i16::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i16::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i16::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i16::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                let s = |k: usize| d * f32::from(sc[is + k] as i8);
                o[l] = s(0) * f32::from(q1);
                o[l + 32] = s(2) * f32::from(q2);
                o[l + 64] = s(4) * f32::from(q3);
                o[l + 96] = s(6) * f32::from(q4);
            }
        }
    }
}

/// A `[rows, cols]` matrix of super-blocks of format `F`, as GGUF stores it.
#[derive(Debug, Clone)]
pub struct SuperBlockMatrix<F> {
    bytes: Bytes,
    rows: usize,
    cols: usize,
    format: PhantomData<F>,
}

impl<F: SuperBlock> SuperBlockMatrix<F> {
    /// `None` when the sizes disagree.
    pub fn new(bytes: Bytes, rows: usize, cols: usize) -> Option<Self> {
        let ok = cols.is_multiple_of(SUPER) && bytes.len() == rows * cols / SUPER * F::BYTES;
        ok.then_some(Self {
            bytes,
            rows,
            cols,
            format: PhantomData,
        })
    }

    fn row(&self, r: usize) -> &[u8] {
        let w = self.cols / SUPER * F::BYTES;
        &self.bytes.as_slice()[r * w..(r + 1) * w]
    }
}

impl<F: SuperBlock> WeightMatrix for SuperBlockMatrix<F> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        F::NAME
    }
    fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.bytes.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let mut buf = [0f32; SUPER];
        for (i, r) in rows.enumerate() {
            let o = &mut out[i * self.cols..(i + 1) * self.cols];
            for (ob, b) in o
                .chunks_exact_mut(SUPER)
                .zip(self.row(r).chunks_exact(F::BYTES))
            {
                F::decode(b, &mut buf);
                ob.copy_from_slice(&buf);
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        for (i, r) in rows.enumerate() {
            let row = self.row(r);
            for t in 0..n {
                let xs = &x[t * cols..(t + 1) * cols];
                out[t * len + i] = match F::KIND {
                    KindK::Q4K => dot_q4k(xs, row),
                    KindK::Q5K => dot_q5k(xs, row),
                    KindK::Q6K => dot_q6k(xs, row),
                };
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl<F: SuperBlock> IntegerDots for SuperBlockMatrix<F> {
    fn act_block(&self) -> ActBlock {
        ActBlock::B256
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        matrix_k(F::KIND, rows, self.bytes.as_slice(), acts, out);
    }
}

#[inline(always)]
fn dot_body<F: SuperBlock>(x: &[f32], blocks: &[u8]) -> f32 {
    let mut acc = [0f32; 16];
    let mut w = [0f32; SUPER];
    for (xb, b) in x.chunks_exact(SUPER).zip(blocks.chunks_exact(F::BYTES)) {
        F::decode(b, &mut w);
        for (xs, ws) in xb.chunks_exact(16).zip(w.chunks_exact(16)) {
            for k in 0..16 {
                acc[k] += xs[k] * ws[k];
            }
        }
    }
    acc.iter().sum()
}

#[inline(always)]
fn q4k_body(x: &[f32], b: &[u8]) -> f32 {
    dot_body::<Q4K>(x, b)
}
#[inline(always)]
fn q5k_body(x: &[f32], b: &[u8]) -> f32 {
    dot_body::<Q5K>(x, b)
}
#[inline(always)]
fn q6k_body(x: &[f32], b: &[u8]) -> f32 {
    dot_body::<Q6K>(x, b)
}
multiversion!(
    /// `Σ x · w` over one row of Q4_K super-blocks.
    pub fn dot_q4k(x: &[f32], b: &[u8]) -> f32 => q4k_body
);
multiversion!(
    /// `Σ x · w` over one row of Q5_K super-blocks.
    pub fn dot_q5k(x: &[f32], b: &[u8]) -> f32 => q5k_body
);
multiversion!(
    /// `Σ x · w` over one row of Q6_K super-blocks.
    pub fn dot_q6k(x: &[f32], b: &[u8]) -> f32 => q6k_body
);
