//! GGUF's legacy 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1) read in
//! place: each block is decoded into registers and multiplied with f32
//! activations at once, so nothing is widened in memory.

use std::marker::PhantomData;
use std::ops::Range;

use crate::dispatch::multiversion;
use crate::intdot::{matrix32, Kind32, Row};
use crate::{f16_to_f32, ActBlock, Bytes, IntegerDots, QuantizedActs, WeightMatrix};

/// Values per block.
pub const BLOCK: usize = 32;

/// One block layout.
pub trait BlockFormat: Send + Sync + std::fmt::Debug + 'static {
    const NAME: &'static str;
    /// The block as the integer kernels decode it.
    const KIND: Kind32;
    const BYTES: usize = Self::KIND.bytes();
    fn decode(block: &[u8], out: &mut [f32; BLOCK]);
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// `d` (f16), 16 bytes of nibbles: `(q − 8) · d`.
#[derive(Debug)]
pub struct Q4_0;
impl BlockFormat for Q4_0 {
    const NAME: &'static str = "Q4_0";
    const KIND: Kind32 = Kind32::Q4_0;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; BLOCK]) {
        let d = half(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            out[j] = (f32::from(qs[j] & 15) - 8.0) * d;
            out[j + 16] = (f32::from(qs[j] >> 4) - 8.0) * d;
        }
    }
}

/// `d`, `m` (f16), 16 bytes of nibbles: `q · d + m`.
#[derive(Debug)]
pub struct Q4_1;
impl BlockFormat for Q4_1 {
    const NAME: &'static str = "Q4_1";
    const KIND: Kind32 = Kind32::Q4_1;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; BLOCK]) {
        let (d, m) = (half(b, 0), half(b, 2));
        let qs = &b[4..20];
        for j in 0..16 {
            out[j] = f32::from(qs[j] & 15) * d + m;
            out[j + 16] = f32::from(qs[j] >> 4) * d + m;
        }
    }
}

/// The fifth bits of a 5-bit block: bit `j` of `qh` for value `j`.
#[inline(always)]
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    let lo = (((qh >> j) << 4) & 0x10) as u8;
    let hi = ((qh >> (j + 12)) & 0x10) as u8;
    (lo, hi)
}

/// `d` (f16), 32 high bits, 16 bytes of nibbles: `(q − 16) · d`.
#[derive(Debug)]
pub struct Q5_0;
impl BlockFormat for Q5_0 {
    const NAME: &'static str = "Q5_0";
    const KIND: Kind32 = Kind32::Q5_0;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; BLOCK]) {
        let d = half(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let (lo, hi) = fifth_bits(qh, j);
            out[j] = (f32::from((qs[j] & 15) | lo) - 16.0) * d;
            out[j + 16] = (f32::from((qs[j] >> 4) | hi) - 16.0) * d;
        }
    }
}

/// `d`, `m` (f16), 32 high bits, 16 bytes of nibbles: `q · d + m`.
#[derive(Debug)]
pub struct Q5_1;
impl BlockFormat for Q5_1 {
    const NAME: &'static str = "Q5_1";
    const KIND: Kind32 = Kind32::Q5_1;
    #[inline(always)]
    fn decode(b: &[u8], out: &mut [f32; BLOCK]) {
        let (d, m) = (half(b, 0), half(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..16 {
            let (lo, hi) = fifth_bits(qh, j);
            out[j] = f32::from((qs[j] & 15) | lo) * d + m;
            out[j + 16] = f32::from((qs[j] >> 4) | hi) * d + m;
        }
    }
}

/// A `[rows, cols]` matrix of blocks of format `F`, row-major, as GGUF stores it.
#[derive(Debug, Clone)]
pub struct BlockMatrix<F> {
    bytes: Bytes,
    rows: usize,
    cols: usize,
    format: PhantomData<F>,
}

impl<F: BlockFormat> BlockMatrix<F> {
    /// `None` when the sizes disagree.
    pub fn new(bytes: Bytes, rows: usize, cols: usize) -> Option<Self> {
        let ok = cols.is_multiple_of(BLOCK) && bytes.len() == rows * cols / BLOCK * F::BYTES;
        ok.then_some(Self {
            bytes,
            rows,
            cols,
            format: PhantomData,
        })
    }

    fn row(&self, r: usize) -> &[u8] {
        let w = self.cols / BLOCK * F::BYTES;
        &self.bytes.as_slice()[r * w..(r + 1) * w]
    }
}

impl<F: BlockFormat> WeightMatrix for BlockMatrix<F> {
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
        let mut buf = [0f32; BLOCK];
        for (i, r) in rows.enumerate() {
            let o = &mut out[i * self.cols..(i + 1) * self.cols];
            for (ob, b) in o
                .chunks_exact_mut(BLOCK)
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
                out[t * len + i] = dot_blocks::<F>(&x[t * cols..(t + 1) * cols], row);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl<F: BlockFormat> IntegerDots for BlockMatrix<F> {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        // The matrix's bytes once, not through the owner at every row.
        let (all, w) = (self.bytes.as_slice(), self.cols / BLOCK * F::BYTES);
        matrix32(
            F::KIND,
            rows,
            &|r| Row::blocks(&all[r * w..(r + 1) * w]),
            acts,
            out,
        );
    }
}

#[inline(always)]
fn dot_blocks_body<F: BlockFormat>(x: &[f32], blocks: &[u8]) -> f32 {
    let mut acc = [0f32; BLOCK];
    let mut w = [0f32; BLOCK];
    for (xb, b) in x.chunks_exact(BLOCK).zip(blocks.chunks_exact(F::BYTES)) {
        F::decode(b, &mut w);
        for k in 0..BLOCK {
            acc[k] += xb[k] * w[k];
        }
    }
    acc.iter().sum()
}

fn dot_blocks<F: BlockFormat>(x: &[f32], blocks: &[u8]) -> f32 {
    match F::KIND {
        Kind32::Q4_0 => dot_q4_0(x, blocks),
        Kind32::Q4_1 => dot_q4_1(x, blocks),
        Kind32::Q5_0 => dot_q5_0(x, blocks),
        _ => dot_q5_1(x, blocks),
    }
}

#[inline(always)]
fn q4_0_body(x: &[f32], b: &[u8]) -> f32 {
    dot_blocks_body::<Q4_0>(x, b)
}
#[inline(always)]
fn q4_1_body(x: &[f32], b: &[u8]) -> f32 {
    dot_blocks_body::<Q4_1>(x, b)
}
#[inline(always)]
fn q5_0_body(x: &[f32], b: &[u8]) -> f32 {
    dot_blocks_body::<Q5_0>(x, b)
}
#[inline(always)]
fn q5_1_body(x: &[f32], b: &[u8]) -> f32 {
    dot_blocks_body::<Q5_1>(x, b)
}
multiversion!(
    /// `Σ x · w` over one row of Q4_0 blocks.
    pub fn dot_q4_0(x: &[f32], b: &[u8]) -> f32 => q4_0_body
);
multiversion!(
    /// `Σ x · w` over one row of Q4_1 blocks.
    pub fn dot_q4_1(x: &[f32], b: &[u8]) -> f32 => q4_1_body
);
multiversion!(
    /// `Σ x · w` over one row of Q5_0 blocks.
    pub fn dot_q5_0(x: &[f32], b: &[u8]) -> f32 => q5_0_body
);
multiversion!(
    /// `Σ x · w` over one row of Q5_1 blocks.
    pub fn dot_q5_1(x: &[f32], b: &[u8]) -> f32 => q5_1_body
);
