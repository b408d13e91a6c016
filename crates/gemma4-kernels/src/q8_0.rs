//! GGUF Q8_0 blocks read in place: an f16 scale and 32 signed bytes per
//! block, values `d · q`. Activations stay in f32, so products match the
//! dequantized f32 product up to summation order.

use std::ops::Range;

use half::f16;

use crate::dispatch::multiversion;
use crate::intdot::{matrix32, Kind32, Row};
use crate::{ActBlock, Bytes, IntegerDots, QuantizedActs, WeightMatrix};

/// Values per block.
pub const BLOCK: usize = 32;
/// Bytes per block: f16 scale + 32 quants.
pub const BLOCK_BYTES: usize = Kind32::Q8_0.bytes();

/// A `[rows, cols]` matrix of Q8_0 blocks, row-major, as GGUF stores it.
#[derive(Debug, Clone)]
pub struct Q8_0Matrix {
    bytes: Bytes,
    rows: usize,
    cols: usize,
}

impl Q8_0Matrix {
    /// `None` when the sizes disagree.
    pub fn new(bytes: Bytes, rows: usize, cols: usize) -> Option<Self> {
        let ok = cols.is_multiple_of(BLOCK) && bytes.len() == rows * cols / BLOCK * BLOCK_BYTES;
        ok.then_some(Self { bytes, rows, cols })
    }

    fn row(&self, r: usize) -> &[u8] {
        let w = self.cols / BLOCK * BLOCK_BYTES;
        &self.bytes.as_slice()[r * w..(r + 1) * w]
    }
}

impl WeightMatrix for Q8_0Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        "Q8_0"
    }
    fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.bytes.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        for (i, r) in rows.enumerate() {
            let o = &mut out[i * self.cols..(i + 1) * self.cols];
            for (ob, b) in o
                .chunks_exact_mut(BLOCK)
                .zip(self.row(r).chunks_exact(BLOCK_BYTES))
            {
                let d = crate::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                for (v, &q) in ob.iter_mut().zip(&b[2..]) {
                    *v = d * f32::from(q as i8);
                }
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        for (i, r) in rows.enumerate() {
            let row = self.row(r);
            for t in 0..n {
                out[t * len + i] = dot_q8_0(&x[t * cols..(t + 1) * cols], row);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl IntegerDots for Q8_0Matrix {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        // The matrix's bytes once, not through the owner at every row.
        let (all, w) = (self.bytes.as_slice(), self.cols / BLOCK * BLOCK_BYTES);
        matrix32(
            Kind32::Q8_0,
            rows,
            &|r| Row::blocks(&all[r * w..(r + 1) * w]),
            acts,
            out,
        );
    }
}

#[inline(always)]
fn dot_q8_0_body(x: &[f32], blocks: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (xb, b) in x.chunks_exact(BLOCK).zip(blocks.chunks_exact(BLOCK_BYTES)) {
        let d = crate::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        let q = &b[2..];
        let mut part = [0f32; 8];
        for (q8, x8) in q.chunks_exact(8).zip(xb.chunks_exact(8)) {
            for k in 0..8 {
                part[k] += f32::from(q8[k] as i8) * x8[k];
            }
        }
        for k in 0..8 {
            acc[k] += d * part[k];
        }
    }
    acc.iter().sum()
}

multiversion!(
    /// `Σ x · w` over one row of Q8_0 blocks.
    pub fn dot_q8_0(x: &[f32], blocks: &[u8]) -> f32 => dot_q8_0_body
);

/// Quantizes rows of `values` to Q8_0 bytes the way ggml does (`d = max |x| / 127`).
pub fn quantize(values: &[f32], cols: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / BLOCK * BLOCK_BYTES);
    for row in values.chunks(cols) {
        for block in row.chunks(BLOCK) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_matmul, values};

    #[test]
    fn products_match_the_dequantized_blocks() {
        let (rows, cols) = (37, 96);
        let w = values(rows * cols, 1, 0.3);
        let m = Q8_0Matrix::new(Bytes::from_vec(quantize(&w, cols)), rows, cols).expect("sizes");
        check_matmul(&m);
        assert!(Q8_0Matrix::new(Bytes::from_vec(vec![0; 10]), 1, 32).is_none());
    }
}
