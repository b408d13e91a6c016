//! f32, bf16 and f16 matrices, read in place (e.g. from a memory-mapped
//! safetensors file) and widened in registers.
//!
//! Every row loop asks for the weights [`crate::prefetch_ahead`]'s distance
//! ahead of what it reads: a decode step streams its rows from memory one
//! after another, and the hardware prefetchers alone kept the bf16 rows
//! well below the memory's rate where its latency is high.

use std::ops::Range;

use half::f16;

use crate::dispatch::multiversion;
use crate::{Bytes, WeightMatrix};

/// Lanes of independent partial sums: enough for the compiler to fill a
/// vector register and hide the add latency.
const LANES: usize = 16;

/// Element types a float matrix can hold, stored little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    F32,
    Bf16,
    F16,
}

impl FloatType {
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::Bf16 | FloatType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::Bf16 => "bf16",
            FloatType::F16 => "f16",
        }
    }
}

/// A `[rows, cols]` matrix of f32, bf16 or f16 values.
#[derive(Debug, Clone)]
pub struct FloatMatrix {
    bytes: Bytes,
    ty: FloatType,
    rows: usize,
    cols: usize,
}

impl FloatMatrix {
    /// `None` when the byte count does not match the shape.
    pub fn new(bytes: Bytes, ty: FloatType, rows: usize, cols: usize) -> Option<Self> {
        (bytes.len() == rows.checked_mul(cols)?.checked_mul(ty.size())?).then_some(Self {
            bytes,
            ty,
            rows,
            cols,
        })
    }

    pub fn from_f32(values: &[f32], rows: usize, cols: usize) -> Option<Self> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(Bytes::from_vec(bytes), FloatType::F32, rows, cols)
    }

    pub fn float_type(&self) -> FloatType {
        self.ty
    }

    fn row_bytes(&self, r: usize) -> &[u8] {
        let w = self.cols * self.ty.size();
        &self.bytes.as_slice()[r * w..(r + 1) * w]
    }
}

impl WeightMatrix for FloatMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        self.ty.name()
    }
    fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.bytes.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let w = self.cols * self.ty.size();
        let src = &self.bytes.as_slice()[rows.start * w..rows.end * w];
        widen(self.ty, src, out);
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let len = rows.len();
        let cols = self.cols;
        for (i, r) in rows.enumerate() {
            let row = self.row_bytes(r);
            for t in 0..n {
                let xs = &x[t * cols..(t + 1) * cols];
                out[t * len + i] = match self.ty {
                    FloatType::F32 => dot_f32_bytes(xs, row),
                    FloatType::Bf16 => dot_bf16(xs, row),
                    FloatType::F16 => dot_f16(xs, row),
                };
            }
        }
    }
}

/// Widens stored values to f32.
pub fn widen(ty: FloatType, src: &[u8], out: &mut [f32]) {
    match ty {
        FloatType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        FloatType::Bf16 => widen_bf16(src, out),
        FloatType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

#[inline(always)]
fn bf16_bits(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

#[inline(always)]
fn widen_bf16_body(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_bits(b);
    }
}

multiversion!(
    /// bf16 bytes → f32.
    pub fn widen_bf16(src: &[u8], out: &mut [f32]) => widen_bf16_body
);

#[inline(always)]
fn dot_f32_body(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (xc, wc) = (x.chunks_exact(LANES), w.chunks_exact(LANES));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        for k in 0..LANES {
            acc[k] += xs[k] * ws[k];
        }
    }
    let tail: f32 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
    acc.iter().sum::<f32>() + tail
}

multiversion!(
    /// `Σ x[i] · w[i]` over f32 slices of equal length.
    pub fn dot_f32(x: &[f32], w: &[f32]) -> f32 => dot_f32_body
);

#[inline(always)]
fn dot_f32_bytes_body(x: &[f32], w: &[u8]) -> f32 {
    let mut acc = [0f32; LANES];
    let (xc, wc) = (x.chunks_exact(LANES), w.chunks_exact(LANES * 4));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        crate::prefetch_ahead(ws.as_ptr(), 64);
        for k in 0..LANES {
            let b = &ws[4 * k..4 * k + 4];
            acc[k] += xs[k] * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    let tail: f32 = xr
        .iter()
        .zip(wr.chunks_exact(4))
        .map(|(a, b)| a * f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .sum();
    acc.iter().sum::<f32>() + tail
}

multiversion!(
    /// `Σ x[i] · w[i]` with `w` as little-endian f32 bytes.
    pub fn dot_f32_bytes(x: &[f32], w: &[u8]) -> f32 => dot_f32_bytes_body
);

#[inline(always)]
fn dot_bf16_body(x: &[f32], w: &[u8]) -> f32 {
    let mut acc = [0f32; LANES];
    let (xc, wc) = (x.chunks_exact(LANES), w.chunks_exact(LANES * 2));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        crate::prefetch_ahead(ws.as_ptr(), 64);
        for k in 0..LANES {
            acc[k] += xs[k] * bf16_bits(&ws[2 * k..2 * k + 2]);
        }
    }
    let tail: f32 = xr
        .iter()
        .zip(wr.chunks_exact(2))
        .map(|(a, b)| a * bf16_bits(b))
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// `Σ x[i] · w[i]` with `w` as little-endian bf16 bytes: several FMA
/// chains in the widest registers the CPU has. The portable body's one
/// chain of adds waited on each add's latency, which held a decode step's
/// bf16 rows below the memory's rate.
pub fn dot_bf16(x: &[f32], w: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match crate::dispatch::level() {
        // SAFETY: `level` reported AVX-512 (F, BW) and FMA on this CPU.
        crate::dispatch::Level::Avx512 => return unsafe { dot_bf16_avx512(x, w) },
        // SAFETY: `level` reported AVX2 and FMA on this CPU.
        crate::dispatch::Level::Avx2 => return unsafe { dot_bf16_avx2(x, w) },
        crate::dispatch::Level::Portable => {}
    }
    dot_bf16_body(x, w)
}

/// The values past the vector loop's last whole step, value by value.
#[cfg(target_arch = "x86_64")]
fn dot_bf16_tail(x: &[f32], w: &[u8], from: usize) -> f32 {
    x[from..]
        .iter()
        .zip(w[2 * from..].chunks_exact(2))
        .map(|(a, b)| a * bf16_bits(b))
        .sum()
}

/// [`dot_bf16`] in 512-bit registers: 64 values a step in four FMA chains.
///
/// # Safety
/// The CPU must have AVX-512 F and BW, and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn dot_bf16_avx512(x: &[f32], w: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(w.len() / 2);
    let main = n / 64 * 64;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    for i in (0..main).step_by(64) {
        crate::prefetch_ahead(wp.add(2 * i), 128);
        for (k, a) in acc.iter_mut().enumerate() {
            let at = i + 16 * k;
            // SAFETY: `at + 16 ≤ main ≤ n`: in bounds of both slices. A
            // bf16 is the high half of the f32 with the same bits.
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(wp.add(2 * at).cast()));
            let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits));
            *a = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(at)), wv, *a);
        }
    }
    let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(v) + dot_bf16_tail(x, w, main)
}

/// `Σ x[i] · w[i]` over the whole steps of 32 two-byte values, in four FMA
/// chains of 256-bit registers, with `widen` turning eight stored values
/// into f32; returns the sum and where the steps end (the caller adds the
/// rest). Inlined into callers that enable AVX2 and FMA (and whatever
/// `widen` needs).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_halves_avx2(
    x: &[f32],
    w: &[u8],
    widen: impl Fn(*const u8) -> std::arch::x86_64::__m256,
) -> (f32, usize) {
    use std::arch::x86_64::*;
    let n = x.len().min(w.len() / 2);
    let main = n / 32 * 32;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..main).step_by(32) {
        crate::prefetch_ahead(wp.add(2 * i), 64);
        for (k, a) in acc.iter_mut().enumerate() {
            let at = i + 8 * k;
            // SAFETY: `at + 8 ≤ main ≤ n`: in bounds of both slices.
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(at)), widen(wp.add(2 * at)), *a);
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    (_mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half))), main)
}

/// [`dot_bf16`] in 256-bit registers: 32 values a step in four FMA chains.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2(x: &[f32], w: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    // A bf16 is the high half of the f32 with the same bits.
    let (sum, main) = dot_halves_avx2(x, w, |p| {
        let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
    });
    sum + dot_bf16_tail(x, w, main)
}

#[inline(always)]
fn dot_f16_body(x: &[f32], w: &[u8]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut buf = [0f32; LANES];
    let (xc, wc) = (x.chunks_exact(LANES), w.chunks_exact(LANES * 2));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        crate::prefetch_ahead(ws.as_ptr(), 64);
        for k in 0..LANES {
            buf[k] = crate::f16_to_f32(u16::from_le_bytes([ws[2 * k], ws[2 * k + 1]]));
        }
        for k in 0..LANES {
            acc[k] += xs[k] * buf[k];
        }
    }
    let tail: f32 = xr
        .iter()
        .zip(wr.chunks_exact(2))
        .map(|(a, b)| a * f16::from_le_bytes([b[0], b[1]]).to_f32())
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// `Σ x[i] · w[i]` with `w` as little-endian f16 bytes: F16C's conversion
/// where the CPU has it (the portable body converts bit by bit, which made
/// f16 rows four times slower than bf16's).
pub fn dot_f16(x: &[f32], w: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::dispatch::level() != crate::dispatch::Level::Portable
        && is_x86_feature_detected!("f16c")
    {
        // SAFETY: AVX2, FMA and F16C were detected.
        return unsafe { dot_f16_f16c(x, w) };
    }
    dot_f16_body(x, w)
}

/// [`dot_f16`] with `vcvtph2ps`: 32 values a step in four FMA chains.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_f16c(x: &[f32], w: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let (sum, main) = dot_halves_avx2(x, w, |p| _mm256_cvtph_ps(_mm_loadu_si128(p.cast())));
    let tail: f32 = x[main..]
        .iter()
        .zip(w[2 * main..].chunks_exact(2))
        .map(|(a, b)| a * crate::f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
        .sum();
    sum + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_matmul, encode_floats, values};

    fn matrix(ty: FloatType, rows: usize, cols: usize) -> FloatMatrix {
        let bytes = encode_floats(ty, &values(rows * cols, 3, 0.5));
        FloatMatrix::new(Bytes::from_vec(bytes), ty, rows, cols).expect("shape")
    }

    #[test]
    fn every_float_type_matches_the_reference_product() {
        for ty in [FloatType::F32, FloatType::Bf16, FloatType::F16] {
            // Odd sizes exercise the remainders and a partial last tile.
            check_matmul(&matrix(ty, 131, 77));
            check_matmul(&matrix(ty, 8, 256));
        }
    }

    #[test]
    fn bf16_dots_match_the_f64_sum_at_every_length() {
        // Lengths around each path's step (16, 32, 64 values) and its tail.
        for len in [0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 200, 640] {
            let x = values(len, 9, 1.0);
            let m = matrix(FloatType::Bf16, 1, len);
            let w = m.row_bytes(0);
            let want: f64 = x
                .iter()
                .zip(w.chunks_exact(2))
                .map(|(a, b)| f64::from(*a) * f64::from(bf16_bits(b)))
                .sum();
            let bound: f64 = x
                .iter()
                .zip(w.chunks_exact(2))
                .map(|(a, b)| (f64::from(*a) * f64::from(bf16_bits(b))).abs())
                .sum();
            for (name, got) in [
                ("dispatched", dot_bf16(&x, w)),
                ("portable", dot_bf16_body(&x, w)),
            ] {
                // The rounding error of an f32 sum of `len` products.
                let tolerance = len as f64 * f64::from(f32::EPSILON) * bound;
                let err = (f64::from(got) - want).abs();
                assert!(err <= tolerance, "{name} len {len}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn bf16_widening_is_exact() {
        let m = matrix(FloatType::Bf16, 4, 33);
        let mut out = vec![0f32; 4 * 33];
        m.dequantize_rows(0..4, &mut out);
        let v = values(4 * 33, 3, 0.5);
        for (o, x) in out.iter().zip(&v) {
            assert_eq!(*o, half::bf16::from_f32(*x).to_f32());
        }
    }

    #[test]
    fn wrong_sizes_are_refused() {
        assert!(FloatMatrix::new(Bytes::from_vec(vec![0; 10]), FloatType::Bf16, 2, 3).is_none());
    }
}
