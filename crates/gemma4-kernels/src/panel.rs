//! A short, wide matrix (a few rows of many values, e.g. a LoRA adapter's
//! `Bᵀ`) stored in panels of [`PANEL`] columns, every row's piece of one
//! panel side by side, for adding a combination of its rows into a slice
//! of outputs (`out += Σ_k c[k] · m[k, ·]`).
//!
//! Row by row, that combination reads each row's piece of the columns as
//! its own short run and passes over the outputs once per row. In panels,
//! a slice of columns is one run of bytes read once, and each panel's
//! outputs stay in registers while every row is added.

use std::ops::Range;

use half::f16;

use crate::dispatch::multiversion;
use crate::float::FloatType;
use crate::Bytes;

/// Columns per panel: four 512-bit registers of f32 outputs.
pub const PANEL: usize = 64;

/// A `[rows, cols]` matrix of f32, bf16 or f16 values in panels: panel
/// `p` holds columns `p · PANEL ..` of row 0, then of row 1, and so on;
/// the last panel is narrower when `cols` is not a multiple of [`PANEL`].
#[derive(Debug, Clone)]
pub struct PanelMatrix {
    bytes: Bytes,
    ty: FloatType,
    rows: usize,
    cols: usize,
}

impl PanelMatrix {
    /// The matrix whose row-major little-endian values of type `ty` are
    /// `src`; `None` when the byte count does not match the shape.
    pub fn from_row_major(src: &[u8], ty: FloatType, rows: usize, cols: usize) -> Option<Self> {
        let size = ty.size();
        if src.len() != rows.checked_mul(cols)?.checked_mul(size)? {
            return None;
        }
        let mut bytes = Vec::with_capacity(src.len());
        for panel in panels(0..cols) {
            for r in 0..rows {
                let start = (r * cols + panel.start) * size;
                bytes.extend_from_slice(&src[start..start + panel.len() * size]);
            }
        }
        Some(Self {
            bytes: Bytes::from_vec(bytes),
            ty,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values widened to f32, row-major (`[rows, cols]`).
    pub fn to_f32_rows(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for panel in panels(0..self.cols) {
            let bytes = self.panel_bytes(&panel);
            let width = panel.len();
            for (r, row) in bytes.chunks_exact(width * self.ty.size()).enumerate() {
                let at = r * self.cols + panel.start;
                for (o, b) in out[at..at + width]
                    .iter_mut()
                    .zip(row.chunks_exact(self.ty.size()))
                {
                    *o = widen_one(self.ty, b);
                }
            }
        }
        out
    }

    /// `out[j] += Σ_k coeffs[k] · m[k, from + j]` for every `j` of `out`:
    /// for each value the products of rows 0, 1, … added in that order,
    /// one rounding for the product and one for the sum (no fused
    /// multiply-add), so a column's result is the same however the columns
    /// are split and whatever the instruction set.
    ///
    /// # Panics
    /// When `coeffs` does not have one value per row or the columns run
    /// past the matrix.
    pub fn add_combination(&self, coeffs: &[f32], from: usize, out: &mut [f32]) {
        assert_eq!(coeffs.len(), self.rows, "one coefficient per row");
        assert!(from + out.len() <= self.cols, "columns past the matrix");
        let mut done = 0;
        while done < out.len() {
            let col = from + done;
            let first = col / PANEL * PANEL;
            let panel = first..(first + PANEL).min(self.cols);
            let bytes = self.panel_bytes(&panel);
            let skip = col - panel.start;
            let take = (panel.len() - skip).min(out.len() - done);
            let part = &mut out[done..done + take];
            if skip == 0 && take == PANEL {
                // Whole panels from here on, as many as `out` covers.
                let whole = (out.len() - done) / PANEL;
                let whole = whole.min(self.cols / PANEL - col / PANEL);
                let span = PANEL * self.rows * self.ty.size();
                let start = (col / PANEL) * span;
                let bytes = &self.bytes.as_slice()[start..start + whole * span];
                let part = &mut out[done..done + whole * PANEL];
                match self.ty {
                    FloatType::Bf16 => add_panels_bf16(part, coeffs, bytes),
                    FloatType::F32 => add_panels_f32(part, coeffs, bytes),
                    FloatType::F16 => add_panels_f16(part, coeffs, bytes),
                }
                done += whole * PANEL;
                continue;
            }
            add_part(self.ty, part, coeffs, bytes, panel.len(), skip);
            done += take;
        }
    }

    /// Panel `panel`'s bytes (every row's piece).
    fn panel_bytes(&self, panel: &Range<usize>) -> &[u8] {
        let start = panel.start * self.rows * self.ty.size();
        &self.bytes.as_slice()[start..start + panel.len() * self.rows * self.ty.size()]
    }
}

/// The panels' column ranges over `cols`.
fn panels(cols: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let end = cols.end;
    (cols.start..end)
        .step_by(PANEL)
        .map(move |c| c..(c + PANEL).min(end))
}

#[inline(always)]
fn widen_one(ty: FloatType, b: &[u8]) -> f32 {
    match ty {
        FloatType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        FloatType::Bf16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        FloatType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

/// Columns `skip..skip + out.len()` of one panel `width` columns wide,
/// value by value.
fn add_part(
    ty: FloatType,
    out: &mut [f32],
    coeffs: &[f32],
    panel: &[u8],
    width: usize,
    skip: usize,
) {
    let size = ty.size();
    for (j, o) in out.iter_mut().enumerate() {
        let mut acc = *o;
        for (k, c) in coeffs.iter().enumerate() {
            let at = (k * width + skip + j) * size;
            acc += c * widen_one(ty, &panel[at..at + size]);
        }
        *o = acc;
    }
}

/// Whole panels: `out` holds `PANEL` values per panel of `bytes`. The
/// panel's outputs are one fixed-size array, which the compiler keeps in
/// vector registers across the rows.
#[inline(always)]
fn add_panels_body<const SIZE: usize>(
    out: &mut [f32],
    coeffs: &[f32],
    bytes: &[u8],
    widen: impl Fn(&[u8]) -> f32,
) {
    let span = PANEL * SIZE * coeffs.len();
    for (o, panel) in out.chunks_exact_mut(PANEL).zip(bytes.chunks_exact(span)) {
        let mut acc = [0f32; PANEL];
        acc.copy_from_slice(o);
        for (c, row) in coeffs.iter().zip(panel.chunks_exact(PANEL * SIZE)) {
            crate::prefetch_ahead(row.as_ptr(), PANEL * SIZE);
            for (a, w) in acc.iter_mut().zip(row.chunks_exact(SIZE)) {
                *a += c * widen(w);
            }
        }
        o.copy_from_slice(&acc);
    }
}

#[inline(always)]
fn add_panels_bf16_body(out: &mut [f32], coeffs: &[f32], bytes: &[u8]) {
    add_panels_body::<2>(out, coeffs, bytes, |b| widen_one(FloatType::Bf16, b));
}

#[inline(always)]
fn add_panels_f32_body(out: &mut [f32], coeffs: &[f32], bytes: &[u8]) {
    add_panels_body::<4>(out, coeffs, bytes, |b| widen_one(FloatType::F32, b));
}

multiversion!(
    /// Whole bf16 panels.
    pub fn add_panels_bf16(out: &mut [f32], coeffs: &[f32], bytes: &[u8]) => add_panels_bf16_body
);

multiversion!(
    /// Whole f32 panels.
    pub fn add_panels_f32(out: &mut [f32], coeffs: &[f32], bytes: &[u8]) => add_panels_f32_body
);

/// Whole f16 panels (rare in adapter files: value by value).
fn add_panels_f16(out: &mut [f32], coeffs: &[f32], bytes: &[u8]) {
    let span = PANEL * 2 * coeffs.len();
    for (o, panel) in out.chunks_exact_mut(PANEL).zip(bytes.chunks_exact(span)) {
        add_part(FloatType::F16, o, coeffs, panel, PANEL, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{encode_floats as encode, values};

    #[test]
    fn combinations_equal_row_by_row_sums_for_any_split() {
        for ty in [FloatType::F32, FloatType::Bf16, FloatType::F16] {
            for (rows, cols) in [(1, 1), (3, 64), (16, 200), (5, 256), (16, 1536), (2, 63)] {
                let src = encode(ty, &values(rows * cols, 7, 1.0));
                let m = PanelMatrix::from_row_major(&src, ty, rows, cols).expect("shape");
                let widened = m.to_f32_rows();
                let size = ty.size();
                for (w, b) in widened.iter().zip(src.chunks_exact(size)) {
                    assert_eq!(w.to_bits(), widen_one(ty, b).to_bits());
                }
                let coeffs = values(rows, 3, 4.0);
                let start = values(cols, 11, 2.0);
                // The reference: one pass per row, product then sum.
                let mut want = start.clone();
                for (k, c) in coeffs.iter().enumerate() {
                    for (o, w) in want.iter_mut().zip(&widened[k * cols..(k + 1) * cols]) {
                        *o += c * w;
                    }
                }
                for split in [1, 7, 64, 100, 128, cols] {
                    let mut got = start.clone();
                    for (i, part) in got.chunks_mut(split).enumerate() {
                        m.add_combination(&coeffs, i * split, part);
                    }
                    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{ty:?} {rows}x{cols} split {split} col {j}"
                        );
                    }
                }
                // The portable bodies give the same bits as the dispatched ones.
                let whole = cols / PANEL * PANEL;
                let span = whole * rows * size;
                let mut portable = start[..whole].to_vec();
                match ty {
                    FloatType::Bf16 => {
                        add_panels_bf16_body(&mut portable, &coeffs, &m.bytes.as_slice()[..span])
                    }
                    FloatType::F32 => {
                        add_panels_f32_body(&mut portable, &coeffs, &m.bytes.as_slice()[..span])
                    }
                    FloatType::F16 => {
                        add_panels_f16(&mut portable, &coeffs, &m.bytes.as_slice()[..span])
                    }
                }
                for (p, w) in portable.iter().zip(&want) {
                    assert_eq!(p.to_bits(), w.to_bits(), "{ty:?} {rows}x{cols} portable");
                }
            }
        }
    }

    #[test]
    fn wrong_sizes_are_refused() {
        assert!(PanelMatrix::from_row_major(&[0; 10], FloatType::Bf16, 2, 3).is_none());
    }
}
