//! 4-bit weights in groups of 32 with one f32 scale per group, the
//! `--quant q4` layout.
//!
//! The grid is ggml's Q4_0 (levels −8..=7 times the group's scale, the
//! level −8 at the group's largest magnitude), the grid Google's
//! quantization-aware-trained `q4_0` checkpoints were trained on, so such a
//! checkpoint's bf16 values land back on their own levels. Scales are kept
//! in f32 (not Q4_0's f16) so that recovery is exact, and quants and scales
//! sit in separate arrays for plain vector loads: 5 bits per weight.

use std::ops::Range;

use crate::arena::Filling;
use crate::dispatch::multiversion;
use crate::intdot::{matrix32, Kind32, Row};
use crate::{ActBlock, IntegerDots, QuantizedActs, WeightMatrix};

/// Values per group.
pub const GROUP: usize = 32;

/// A `[rows, cols]` matrix of 4-bit groups; `cols` is a multiple of [`GROUP`].
#[derive(Debug)]
pub struct Q4Matrix {
    /// 16 bytes per group: value j in the low nibble of byte j, value j + 16
    /// in the high one; in the weight arena (huge pages; see [`crate::arena`]).
    nibbles: Filling,
    scales: Vec<f32>,
    rows: usize,
    cols: usize,
}

/// What quantizing a matrix found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Q4Report {
    pub groups: usize,
    /// Groups whose values already sat on their Q4_0 grid (quantization-aware training).
    pub on_grid: usize,
}

impl Q4Matrix {
    /// Quantizes `src`; `None` when `cols` is not a multiple of [`GROUP`].
    pub fn quantize(src: &dyn WeightMatrix) -> Option<(Self, Q4Report)> {
        let mut m = Self::with_capacity(src.rows(), src.cols())?;
        let report = m.append_quantized(src)?;
        Some((m, report))
    }

    /// An empty matrix `cols` wide with room for `rows` rows, for
    /// [`Self::append_quantized`] (so a matrix quantized a slice at a time
    /// goes straight into its final buffer); `None` when `cols` is not a
    /// multiple of [`GROUP`].
    pub fn with_capacity(rows: usize, cols: usize) -> Option<Self> {
        cols.is_multiple_of(GROUP).then(|| Self {
            nibbles: Filling::with_capacity(rows * cols / 2),
            scales: Vec::with_capacity(rows * cols / GROUP),
            rows: 0,
            cols,
        })
    }

    /// Quantizes the rows of `src` onto the end; `None` (and nothing added)
    /// when its width differs.
    pub fn append_quantized(&mut self, src: &dyn WeightMatrix) -> Option<Q4Report> {
        let cols = self.cols;
        if src.cols() != cols {
            return None;
        }
        let mut report = Q4Report {
            groups: src.rows() * cols / GROUP,
            on_grid: 0,
        };
        let mut row = vec![0f32; cols];
        let mut packed = [0u8; GROUP / 2];
        for r in 0..src.rows() {
            src.dequantize_rows(r..r + 1, &mut row);
            for values in row.chunks_exact(GROUP) {
                let (scale, on_grid) = quantize_group(values, &mut packed);
                self.nibbles.extend_from_slice(&packed);
                self.scales.push(scale);
                report.on_grid += usize::from(on_grid);
            }
        }
        self.rows += src.rows();
        Some(report)
    }
}

/// One group onto its grid; returns the scale and whether every value was
/// already within 1% of a step of its level.
fn quantize_group(values: &[f32], out: &mut [u8]) -> (f32, bool) {
    let max = values
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let scale = max / -8.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut on_grid = true;
    let level = |v: f32| {
        let l = v * inv;
        let q = l.round().clamp(-8.0, 7.0);
        (q, (l - q).abs() <= 0.01)
    };
    for j in 0..GROUP / 2 {
        let (lo, a) = level(values[j]);
        let (hi, b) = level(values[j + GROUP / 2]);
        on_grid &= a && b;
        out[j] = (lo + 8.0) as u8 | (((hi + 8.0) as u8) << 4);
    }
    (scale, on_grid)
}

impl Q4Matrix {
    /// A matrix from levels packed in element order, two to a byte (the low
    /// nibble first), each stored as `level + 8`, with one scale per group of
    /// [`GROUP`] values, row by row: the int4 packing of compressed-tensors'
    /// `pack-quantized` format. `None` when the sizes do not fit.
    pub fn from_packed_levels(
        rows: usize,
        cols: usize,
        packed: &[u8],
        scales: Vec<f32>,
    ) -> Option<Self> {
        if !cols.is_multiple_of(GROUP)
            || packed.len() != rows * cols / 2
            || scales.len() != rows * cols / GROUP
        {
            return None;
        }
        let mut nibbles = Filling::with_capacity(packed.len());
        let mut group = [0u8; GROUP / 2];
        for src in packed.chunks_exact(GROUP / 2) {
            let level = |e: usize| (src[e / 2] >> (4 * (e % 2))) & 15;
            for (j, d) in group.iter_mut().enumerate() {
                *d = level(j) | (level(j + GROUP / 2) << 4);
            }
            nibbles.extend_from_slice(&group);
        }
        Some(Self {
            nibbles,
            scales,
            rows,
            cols,
        })
    }
}

impl WeightMatrix for Q4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        "q4"
    }
    fn stored_bytes(&self) -> usize {
        self.nibbles.len() + 4 * self.scales.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.nibbles.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let per_row = self.cols / GROUP;
        let nibbles = self.nibbles.as_slice();
        for (i, r) in rows.enumerate() {
            let row_out = &mut out[i * self.cols..(i + 1) * self.cols];
            for g in 0..per_row {
                let gi = r * per_row + g;
                let s = self.scales[gi];
                let q = &nibbles[gi * GROUP / 2..(gi + 1) * GROUP / 2];
                let o = &mut row_out[g * GROUP..(g + 1) * GROUP];
                for j in 0..GROUP / 2 {
                    o[j] = s * (f32::from(q[j] & 15) - 8.0);
                    o[j + GROUP / 2] = s * (f32::from(q[j] >> 4) - 8.0);
                }
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        let per_row = cols / GROUP;
        let nibbles = self.nibbles.as_slice();
        for (i, r) in rows.enumerate() {
            let q = &nibbles[r * cols / 2..(r + 1) * cols / 2];
            let s = &self.scales[r * per_row..(r + 1) * per_row];
            for t in 0..n {
                out[t * len + i] = dot_q4(&x[t * cols..(t + 1) * cols], q, s);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl IntegerDots for Q4Matrix {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        let cols = self.cols;
        let per_row = cols / GROUP;
        let nibbles = self.nibbles.as_slice();
        let row_of = |r: usize| Row {
            data: &nibbles[r * cols / 2..(r + 1) * cols / 2],
            scales: &self.scales[r * per_row..(r + 1) * per_row],
            scale: 0.0,
        };
        matrix32(Kind32::Q4, rows, &row_of, acts, out);
    }
}

#[inline(always)]
fn dot_q4_body(x: &[f32], q: &[u8], scales: &[f32]) -> f32 {
    let mut acc = [0f32; GROUP / 2];
    for ((xs, qs), &s) in x
        .chunks_exact(GROUP)
        .zip(q.chunks_exact(GROUP / 2))
        .zip(scales)
    {
        let mut part = [0f32; GROUP / 2];
        for j in 0..GROUP / 2 {
            part[j] = xs[j] * (f32::from(qs[j] & 15) - 8.0)
                + xs[j + GROUP / 2] * (f32::from(qs[j] >> 4) - 8.0);
        }
        for j in 0..GROUP / 2 {
            acc[j] += s * part[j];
        }
    }
    acc.iter().sum()
}

multiversion!(
    /// `Σ x · w` over one row of 4-bit groups.
    pub fn dot_q4(x: &[f32], q: &[u8], scales: &[f32]) -> f32 => dot_q4_body
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float::FloatMatrix;
    use crate::testing::{check_matmul, values};

    #[test]
    fn products_match_the_widened_q4_values() {
        let src = FloatMatrix::from_f32(&values(75 * 96, 11, 0.3), 75, 96).expect("shape");
        let (q, report) = Q4Matrix::quantize(&src).expect("width");
        assert_eq!(report.groups, 75 * 3);
        check_matmul(&q);
    }

    /// Levels packed in element order come back as the same values.
    #[test]
    fn packed_levels_read_in_element_order() {
        let (rows, cols) = (3, 64);
        let levels: Vec<i8> = (0..rows * cols)
            .map(|i| ((i * 7 + i / 5) % 16) as i8 - 8)
            .collect();
        let packed: Vec<u8> = levels
            .chunks_exact(2)
            .map(|p| (p[0] + 8) as u8 | (((p[1] + 8) as u8) << 4))
            .collect();
        let scales: Vec<f32> = (0..rows * cols / GROUP)
            .map(|g| 0.01 * (g + 1) as f32)
            .collect();
        let m = Q4Matrix::from_packed_levels(rows, cols, &packed, scales.clone()).expect("sizes");
        let mut out = vec![0f32; rows * cols];
        m.dequantize_rows(0..rows, &mut out);
        for (i, (&o, &l)) in out.iter().zip(&levels).enumerate() {
            assert_eq!(o, f32::from(l) * scales[i / GROUP], "element {i}");
        }
        assert!(Q4Matrix::from_packed_levels(rows, cols, &packed[1..], scales).is_none());
    }

    #[test]
    fn slices_quantized_apart_join_into_the_whole() {
        let v = values(10 * 64, 17, 0.4);
        let q = |v: &[f32], rows| {
            Q4Matrix::quantize(&FloatMatrix::from_f32(v, rows, 64).expect("shape"))
                .expect("width")
                .0
        };
        let whole = q(&v, 10);
        let part = |v: &[f32], rows| FloatMatrix::from_f32(v, rows, 64).expect("shape");
        let mut joined = Q4Matrix::with_capacity(10, 64).expect("width");
        joined
            .append_quantized(&part(&v[..4 * 64], 4))
            .expect("same width");
        joined
            .append_quantized(&part(&v[4 * 64..], 6))
            .expect("same width");
        assert!(joined
            .append_quantized(&FloatMatrix::from_f32(&v[..32], 1, 32).expect("shape"))
            .is_none());
        assert_eq!(
            (joined.nibbles.as_slice(), &joined.scales, joined.rows),
            (whole.nibbles.as_slice(), &whole.scales, 10)
        );
    }

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let v = values(4 * 64, 2, 1.0);
        let src = FloatMatrix::from_f32(&v, 4, 64).expect("shape");
        let (q, _) = Q4Matrix::quantize(&src).expect("width");
        let mut back = vec![0f32; v.len()];
        q.dequantize_rows(0..4, &mut back);
        for (i, (b, x)) in back.iter().zip(&v).enumerate() {
            let scale = q.scales[i / GROUP];
            // Level +8 does not exist (the grid is −8..=7): such a value
            // rounds to 7, one step away; every other value is within half a step.
            let bound = if x / scale > 7.5 { 1.0 } else { 0.5 };
            assert!(
                (b - x).abs() <= bound * scale.abs() + 1e-6,
                "{i}: {b} vs {x}"
            );
        }
    }

    #[test]
    fn values_on_a_q4_0_grid_are_recovered_exactly() {
        // Each group: a scale times levels in −8..=7, −8 at the largest magnitude.
        let mut v = Vec::new();
        for g in 0..8 {
            let d = 0.01 * (g + 1) as f32;
            v.push(-8.0 * d);
            v.extend((1..GROUP).map(|j| d * ((j * 5 + g) % 16) as f32 - 8.0 * d));
        }
        let src = FloatMatrix::from_f32(&v, 2, 128).expect("shape");
        let (q, report) = Q4Matrix::quantize(&src).expect("width");
        assert_eq!(report.on_grid, report.groups);
        let mut back = vec![0f32; v.len()];
        q.dequantize_rows(0..2, &mut back);
        for (b, x) in back.iter().zip(&v) {
            assert!((b - x).abs() <= 1e-6 * x.abs().max(1e-3), "{b} vs {x}");
        }
        // Random values are not on a grid.
        let rnd = FloatMatrix::from_f32(&values(128, 4, 1.0), 1, 128).expect("shape");
        assert!(Q4Matrix::quantize(&rnd).expect("width").1.on_grid < 4);
        assert!(
            Q4Matrix::quantize(&FloatMatrix::from_f32(&[0.0; 30], 1, 30).expect("s")).is_none()
        );
    }
}
