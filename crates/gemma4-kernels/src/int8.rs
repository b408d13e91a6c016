//! Symmetric int8 with one f32 scale per output channel (row), the
//! `--quant int8` layout: a quarter of f32's bytes, half of bf16's.

use std::ops::Range;

use crate::arena::Filling;
use crate::dispatch::multiversion;
use crate::intdot::{matrix32, Kind32, Row};
use crate::{ActBlock, IntegerDots, QuantizedActs, WeightMatrix};

const LANES: usize = 16;

/// `W[r, c] ≈ scale[r] · q[r, c]`, `q` in −127..=127.
#[derive(Debug)]
pub struct Int8Matrix {
    /// `q` as bytes, in the weight arena (huge pages; see [`crate::arena`]).
    quants: Filling,
    scales: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Int8Matrix {
    /// Quantizes `src` row by row: `scale = max |w| / 127`, `q = round(w / scale)`.
    pub fn quantize(src: &dyn WeightMatrix) -> Self {
        let mut m = Self::with_capacity(src.rows(), src.cols());
        m.append_quantized(src);
        m
    }

    /// An empty matrix `cols` wide with room for `rows` rows, for
    /// [`Self::append_quantized`]: a matrix quantized a slice at a time goes
    /// straight into its final buffer (reserved, so untouched pages cost
    /// nothing), never through parts that a join would then copy.
    pub fn with_capacity(rows: usize, cols: usize) -> Self {
        Self {
            quants: Filling::with_capacity(rows * cols),
            scales: Vec::with_capacity(rows),
            rows: 0,
            cols,
        }
    }

    /// Quantizes the rows of `src` onto the end; false (and nothing added)
    /// when its width differs.
    pub fn append_quantized(&mut self, src: &dyn WeightMatrix) -> bool {
        let cols = self.cols;
        if src.cols() != cols {
            return false;
        }
        let mut row = vec![0f32; cols];
        let mut levels = vec![0u8; cols];
        for r in 0..src.rows() {
            src.dequantize_rows(r..r + 1, &mut row);
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for (q, v) in levels.iter_mut().zip(&row) {
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
            }
            self.quants.extend_from_slice(&levels);
            self.scales.push(scale);
        }
        self.rows += src.rows();
        true
    }

    /// The levels, row after row.
    fn quants(&self) -> &[i8] {
        let bytes = self.quants.as_slice();
        // SAFETY: i8 has u8's size and alignment, and every bit pattern is
        // an i8.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<i8>(), bytes.len()) }
    }
}

impl WeightMatrix for Int8Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        "int8"
    }
    fn stored_bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.quants.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let cols = self.cols;
        let quants = self.quants();
        for (i, r) in rows.enumerate() {
            let s = self.scales[r];
            for (o, &q) in out[i * cols..(i + 1) * cols]
                .iter_mut()
                .zip(&quants[r * cols..(r + 1) * cols])
            {
                *o = s * f32::from(q);
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        let quants = self.quants();
        for (i, r) in rows.enumerate() {
            let q = &quants[r * cols..(r + 1) * cols];
            for t in 0..n {
                out[t * len + i] = self.scales[r] * dot_i8(&x[t * cols..(t + 1) * cols], q);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl IntegerDots for Int8Matrix {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        let cols = self.cols;
        // The kernel takes the levels' bytes (two's complement) as stored.
        let quants = self.quants.as_slice();
        let row_of = |r: usize| Row {
            data: &quants[r * cols..(r + 1) * cols],
            scales: &[],
            scale: self.scales[r],
        };
        matrix32(Kind32::Int8, rows, &row_of, acts, out);
    }
}

#[inline(always)]
fn dot_i8_body(x: &[f32], q: &[i8]) -> f32 {
    let mut acc = [0f32; LANES];
    let (xc, qc) = (x.chunks_exact(LANES), q.chunks_exact(LANES));
    let (xr, qr) = (xc.remainder(), qc.remainder());
    for (xs, qs) in xc.zip(qc) {
        for k in 0..LANES {
            acc[k] += xs[k] * f32::from(qs[k]);
        }
    }
    let tail: f32 = xr.iter().zip(qr).map(|(a, &b)| a * f32::from(b)).sum();
    acc.iter().sum::<f32>() + tail
}

multiversion!(
    /// `Σ x[i] · q[i]`.
    pub fn dot_i8(x: &[f32], q: &[i8]) -> f32 => dot_i8_body
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float::FloatMatrix;
    use crate::testing::{check_matmul, values};

    #[test]
    fn products_match_the_widened_int8_values() {
        let src = FloatMatrix::from_f32(&values(97 * 80, 5, 0.2), 97, 80).expect("shape");
        check_matmul(&Int8Matrix::quantize(&src));
    }

    #[test]
    fn slices_quantized_apart_join_into_the_whole() {
        let v = values(10 * 64, 13, 0.4);
        let whole = Int8Matrix::quantize(&FloatMatrix::from_f32(&v, 10, 64).expect("shape"));
        let mut joined = Int8Matrix::with_capacity(10, 64);
        assert!(
            joined.append_quantized(&FloatMatrix::from_f32(&v[..4 * 64], 4, 64).expect("shape"))
        );
        assert!(
            joined.append_quantized(&FloatMatrix::from_f32(&v[4 * 64..], 6, 64).expect("shape"))
        );
        assert!(!joined.append_quantized(&FloatMatrix::from_f32(&v[..32], 1, 32).expect("shape")));
        assert_eq!(
            (joined.quants(), &joined.scales, joined.rows),
            (whole.quants(), &whole.scales, 10)
        );
    }

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let v = values(16 * 64, 9, 1.0);
        let src = FloatMatrix::from_f32(&v, 16, 64).expect("shape");
        let q = Int8Matrix::quantize(&src);
        let mut back = vec![0f32; v.len()];
        q.dequantize_rows(0..16, &mut back);
        for r in 0..16 {
            let step = q.scales[r];
            for c in 0..64 {
                let i = r * 64 + c;
                assert!((back[i] - v[i]).abs() <= 0.5 * step + 1e-7, "{r},{c}");
            }
        }
        // A zero row stays zero (no division by zero).
        let z = Int8Matrix::quantize(&FloatMatrix::from_f32(&[0.0; 32], 1, 32).expect("shape"));
        assert!(z.quants().iter().all(|&q| q == 0));
    }
}
