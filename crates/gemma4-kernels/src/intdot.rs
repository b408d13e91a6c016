//! Integer dot products of quantized weight rows with activations rounded
//! to 8 bits per block ([`QuantizedActs`]), as llama.cpp's CPU backend does:
//! the weights' integer levels meet the activations' bytes in 8-bit
//! multiplies with 32-bit sums, and the two scales are applied once per
//! block. It is not exact against the f32 product (the activations are
//! rounded); [`crate::Precision::Exact`] keeps f32 activations.
//!
//! One kernel per block family: the 32-value formats (Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, our int8 and q4 layouts) share one loop over a per-format
//! block decoder, the k-quants (Q4_K, Q5_K, Q6_K) have one each. Chosen at
//! run time: AVX2 ([`crate::intdot_avx2`], which also holds the AVX-512
//! VNNI builds: the one-row decode, the few-row product of the 32-value
//! formats and the k-quant kernel; many rows go to [`crate::intgemm`]),
//! NEON or `sdot` on aarch64 (`intdot_neon`), or portable (the reference
//! in tests).
//! Every kernel decodes a weight block once for up to [`GROUP`] activation
//! rows.

use std::ops::Range;

use crate::acts::{ActBlock, QuantizedActs};
use crate::f16_to_f32;

/// Activation rows that share one decoding of a weight row.
pub const GROUP: usize = 4;

/// The 32-value block formats, as the integer kernels decode them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind32 {
    /// ggml Q8_0: f16 scale, 32 signed bytes.
    Q8_0,
    /// ggml Q4_0: f16 scale, 16 bytes of nibbles, levels − 8.
    Q4_0,
    /// ggml Q4_1: f16 scale and min, 16 bytes of nibbles.
    Q4_1,
    /// ggml Q5_0: f16 scale, 32 fifth bits, 16 bytes of nibbles, levels − 16.
    Q5_0,
    /// ggml Q5_1: f16 scale and min, fifth bits, nibbles.
    Q5_1,
    /// Our int8: 32 signed bytes, the row's scale.
    Int8,
    /// Our q4: 16 bytes of nibbles (levels − 8), an f32 scale per block.
    Q4,
}

impl Kind32 {
    /// Every kind, indexed by the const parameter of the kernels.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const ALL: [Kind32; 7] = [
        Kind32::Q8_0,
        Kind32::Q4_0,
        Kind32::Q4_1,
        Kind32::Q5_0,
        Kind32::Q5_1,
        Kind32::Int8,
        Kind32::Q4,
    ];
    /// Bytes of one block in the row's data.
    pub const fn bytes(self) -> usize {
        match self {
            Kind32::Q8_0 => 34,
            Kind32::Q4_0 => 18,
            Kind32::Q4_1 => 20,
            Kind32::Q5_0 => 22,
            Kind32::Q5_1 => 24,
            Kind32::Int8 => 32,
            Kind32::Q4 => 16,
        }
    }
    /// Whether values are `d · u + m` with unsigned `u` (else `d · v`, signed `v`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const fn affine(self) -> bool {
        matches!(self, Kind32::Q4_1 | Kind32::Q5_1)
    }
}

/// `$body` with `$k` a const, the index of `$kind` in [`Kind32::ALL`]: the
/// x86 and ARM kernels take the kind as a const parameter, so each
/// format's decoder is inlined into its own copy of the loop.
macro_rules! with_kind32 {
    ($kind:expr, $k:ident => $body:expr) => {
        match $kind {
            $crate::intdot::Kind32::Q8_0 => {
                const $k: usize = 0;
                $body
            }
            $crate::intdot::Kind32::Q4_0 => {
                const $k: usize = 1;
                $body
            }
            $crate::intdot::Kind32::Q4_1 => {
                const $k: usize = 2;
                $body
            }
            $crate::intdot::Kind32::Q5_0 => {
                const $k: usize = 3;
                $body
            }
            $crate::intdot::Kind32::Q5_1 => {
                const $k: usize = 4;
                $body
            }
            $crate::intdot::Kind32::Int8 => {
                const $k: usize = 5;
                $body
            }
            $crate::intdot::Kind32::Q4 => {
                const $k: usize = 6;
                $body
            }
        }
    };
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) use with_kind32;

/// The super-block formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindK {
    Q4K,
    Q5K,
    Q6K,
}

impl KindK {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const ALL: [KindK; 3] = [KindK::Q4K, KindK::Q5K, KindK::Q6K];
}

/// One weight row as the kernels read it: its block bytes, and for our
/// layouts the scales kept apart (q4: one per block; int8: the row's).
#[derive(Clone, Copy)]
pub struct Row<'a> {
    pub data: &'a [u8],
    pub scales: &'a [f32],
    pub scale: f32,
}

impl<'a> Row<'a> {
    /// A row of GGUF blocks, scales inside.
    pub fn blocks(data: &'a [u8]) -> Self {
        Self {
            data,
            scales: &[],
            scale: 0.0,
        }
    }
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Block `b` of `row`: 32 integer values and `(d, m)` with `w = d · v + m`.
#[inline(always)]
pub(crate) fn decode32(kind: Kind32, row: &Row, b: usize, v: &mut [i16; 32]) -> (f32, f32) {
    let blk = &row.data[b * kind.bytes()..(b + 1) * kind.bytes()];
    let nibbles = |qs: &[u8], v: &mut [i16; 32], off: i16| {
        for j in 0..16 {
            v[j] = i16::from(qs[j] & 15) - off;
            v[j + 16] = i16::from(qs[j] >> 4) - off;
        }
    };
    let fifth = |qh: u32, v: &mut [i16; 32]| {
        for (i, x) in v.iter_mut().enumerate() {
            *x += (((qh >> i) & 1) as i16) << 4;
        }
    };
    let qh = |at: usize| u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    match kind {
        Kind32::Q8_0 => {
            for (x, &q) in v.iter_mut().zip(&blk[2..34]) {
                *x = i16::from(q as i8);
            }
            (half(blk, 0), 0.0)
        }
        Kind32::Int8 => {
            for (x, &q) in v.iter_mut().zip(blk) {
                *x = i16::from(q as i8);
            }
            (row.scale, 0.0)
        }
        Kind32::Q4_0 => {
            nibbles(&blk[2..18], v, 8);
            (half(blk, 0), 0.0)
        }
        Kind32::Q4 => {
            nibbles(blk, v, 8);
            (row.scales[b], 0.0)
        }
        Kind32::Q4_1 => {
            nibbles(&blk[4..20], v, 0);
            (half(blk, 0), half(blk, 2))
        }
        Kind32::Q5_0 => {
            nibbles(&blk[6..22], v, 0);
            fifth(qh(2), v);
            for x in v.iter_mut() {
                *x -= 16;
            }
            (half(blk, 0), 0.0)
        }
        Kind32::Q5_1 => {
            nibbles(&blk[8..24], v, 0);
            fifth(qh(4), v);
            (half(blk, 0), half(blk, 2))
        }
    }
}

#[inline(always)]
fn dots32_portable_body(
    kind: Kind32,
    row: &Row,
    acts: &QuantizedActs,
    ts: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let blocks = acts.cols / 32;
    let mut acc = [0f32; GROUP];
    let mut v = [0i16; 32];
    for b in 0..blocks {
        let (d, m) = decode32(kind, row, b, &mut v);
        for (k, t) in ts.clone().enumerate() {
            let q = &acts.row(t)[32 * b..32 * b + 32];
            let isum: i32 = v
                .iter()
                .zip(q)
                .map(|(&w, &a)| i32::from(w) * i32::from(a))
                .sum();
            let qsum = || acts.sum16(t, 2 * b) + acts.sum16(t, 2 * b + 1);
            fold32(&mut acc[k], acts.scale(t, b), (d, m), isum, qsum);
        }
    }
    out[..ts.len()].copy_from_slice(&acc[..ts.len()]);
}

/// Adds a block's part to an activation row's sum: the block's integer
/// sum `isum` scaled by the weights' `(d, m)` and the activations' scale
/// `da`, and for formats with a minimum `m` the activations' own sum over
/// the block (`qsum`, asked for only then). Every kernel of the 32-value
/// formats that keeps a row's sum alone folds through this, so they give
/// the portable kernel's bits.
#[inline(always)]
pub(crate) fn fold32(
    acc: &mut f32,
    da: f32,
    (d, m): (f32, f32),
    isum: i32,
    qsum: impl FnOnce() -> i32,
) {
    *acc += da * (d * isum as f32);
    if m != 0.0 {
        *acc += da * m * qsum() as f32;
    }
}

crate::dispatch::multiversion!(
    /// `out[k] = Σ w · x` of one weight row of 32-value blocks with the
    /// activation rows `ts` (at most [`GROUP`]), portably.
    pub fn dots32_portable(
        kind: Kind32,
        row: &Row,
        acts: &QuantizedActs,
        ts: std::ops::Range<usize>,
        out: &mut [f32]
    ) => dots32_portable_body
);

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block.
#[inline(always)]
pub(crate) fn scale_min(j: usize, q: &[u8]) -> (i32, i32) {
    let (d, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (i32::from(d), i32::from(m))
}

/// Super-block `blk` as unsigned levels, with per-16 integer scales and the
/// float factors: `w_i = d · sc[i/16] · u_i − dmin · mn[i/16]` (Q4_K/Q5_K) or
/// `w_i = d · sc[i/16] · (u_i − 32)` (Q6_K, `dmin = 0`, offset folded later).
#[inline(always)]
pub(crate) fn decode_k(
    kind: KindK,
    blk: &[u8],
    u: &mut [u8; 256],
    sc: &mut [i32; 16],
    mn: &mut [i32; 16],
) -> (f32, f32) {
    match kind {
        KindK::Q4K | KindK::Q5K => {
            let (qs, qh) = if kind == KindK::Q4K {
                (&blk[16..144], None)
            } else {
                (&blk[48..176], Some(&blk[16..48]))
            };
            for j in 0..4 {
                let q = &qs[32 * j..32 * j + 32];
                for l in 0..32 {
                    let (mut lo, mut hi) = (q[l] & 15, q[l] >> 4);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    u[64 * j + l] = lo;
                    u[64 * j + 32 + l] = hi;
                }
            }
            scales_k(kind, blk, sc, mn)
        }
        KindK::Q6K => {
            for n in 0..2 {
                let ql = &blk[64 * n..64 * n + 64];
                let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
                let o = &mut u[128 * n..128 * n + 128];
                for l in 0..32 {
                    o[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    o[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            scales_k(kind, blk, sc, mn)
        }
    }
}

/// The scales of super-block `blk`: `(d, dmin)`, and the integer scale and
/// min (0 for Q6_K) of every 16 values.
#[inline(always)]
pub(crate) fn scales_k(
    kind: KindK,
    blk: &[u8],
    sc: &mut [i32; 16],
    mn: &mut [i32; 16],
) -> (f32, f32) {
    match kind {
        KindK::Q4K | KindK::Q5K => {
            for s in 0..8 {
                let (d, m) = scale_min(s, &blk[4..16]);
                sc[2 * s..2 * s + 2].fill(d);
                mn[2 * s..2 * s + 2].fill(m);
            }
            (half(blk, 0), half(blk, 2))
        }
        KindK::Q6K => {
            for (s, &b) in sc.iter_mut().zip(&blk[192..208]) {
                *s = i32::from(b as i8);
            }
            mn.fill(0);
            (half(blk, 208), 0.0)
        }
    }
}

/// Bytes of one super-block.
pub const fn k_bytes(kind: KindK) -> usize {
    match kind {
        KindK::Q4K => 144,
        KindK::Q5K => 176,
        KindK::Q6K => 210,
    }
}

#[inline(always)]
fn dots_k_portable_body(
    kind: KindK,
    row: &[u8],
    acts: &QuantizedActs,
    ts: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let bytes = k_bytes(kind);
    let mut acc = [0f32; GROUP];
    let (mut u, mut sc, mut mn) = ([0u8; 256], [0i32; 16], [0i32; 16]);
    for (s, blk) in row.chunks_exact(bytes).enumerate() {
        let (d, dmin) = decode_k(kind, blk, &mut u, &mut sc, &mut mn);
        for (k, t) in ts.clone().enumerate() {
            let q = &acts.row(t)[256 * s..256 * s + 256];
            let mut isum = 0i32;
            let mut msum = 0i32;
            for g in 0..16 {
                let part: i32 = u[16 * g..16 * g + 16]
                    .iter()
                    .zip(&q[16 * g..16 * g + 16])
                    .map(|(&w, &a)| i32::from(w) * i32::from(a))
                    .sum();
                let gsum = acts.sum16(t, 16 * s + g);
                isum += sc[g] * part;
                if kind == KindK::Q6K {
                    isum -= 32 * sc[g] * gsum;
                }
                msum += mn[g] * gsum;
            }
            fold_k(&mut acc[k], acts.scale(t, s), (d, dmin), isum, msum);
        }
    }
    out[..ts.len()].copy_from_slice(&acc[..ts.len()]);
}

/// Adds a super-block's part to a row's sum: its integer sums over the
/// levels (`isum`, the Q6_K offset folded in) and the mins (`msum`)
/// scaled by the weights' `(d, dmin)` and the activations' scale `da`.
/// Shared by the kernels that give the portable kernel's bits.
#[inline(always)]
pub(crate) fn fold_k(acc: &mut f32, da: f32, (d, dmin): (f32, f32), isum: i32, msum: i32) {
    *acc += da * (d * isum as f32 - dmin * msum as f32);
}

crate::dispatch::multiversion!(
    /// `out[k] = Σ w · x` of one row of k-quant super-blocks with the
    /// activation rows `ts` (at most [`GROUP`]), portably.
    pub fn dots_k_portable(
        kind: KindK,
        row: &[u8],
        acts: &QuantizedActs,
        ts: std::ops::Range<usize>,
        out: &mut [f32]
    ) => dots_k_portable_body
);

#[cfg(test)]
thread_local! {
    /// Set by tests to run the portable kernels on this thread.
    static FORCE_PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the AVX-512 VNNI kernels can run here.
#[inline]
pub fn has_vnni() -> bool {
    #[cfg(test)]
    if FORCE_PORTABLE.with(|f| f.get()) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            crate::dispatch::level() == crate::dispatch::Level::Avx512
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX2 integer kernels ([`crate::intdot_avx2`]) can run here;
/// they serve where the VNNI ones cannot.
#[inline]
pub fn has_avx2() -> bool {
    #[cfg(test)]
    if FORCE_PORTABLE.with(|f| f.get()) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| {
            crate::dispatch::level() != crate::dispatch::Level::Portable
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The level of the aarch64 integer kernels ([`crate::intdot_neon`]) to
/// run, `None` for the portable ones.
#[cfg(target_arch = "aarch64")]
#[inline]
fn neon_level() -> Option<crate::dispatch::Level> {
    #[cfg(test)]
    if FORCE_PORTABLE.with(|f| f.get()) {
        return None;
    }
    let level = crate::dispatch::level();
    (level != crate::dispatch::Level::Portable).then_some(level)
}

/// `out[t · rows.len() + i] = Σ_c acts[t, c] · W[rows.start + i, c]` for a
/// matrix of 32-value blocks whose row `r` is `row_of(r)`, with the fastest
/// kernel this CPU has.
pub fn matrix32<'a>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    assert_eq!(acts.block, ActBlock::B32);
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        if acts.n >= crate::INTGEMM_MIN_ROWS {
            crate::intgemm::matrix32(kind, rows, row_of, acts, out);
        } else if acts.n == 1 {
            // SAFETY: the features the kernel is compiled for were detected.
            unsafe { crate::intdot_avx2::decode32_vnni(kind, rows, row_of, acts, out) };
        } else {
            // SAFETY: the features the kernel is compiled for were detected.
            unsafe { crate::intdot_avx2::few_rows32_vnni(kind, rows, row_of, acts, out) };
        }
        return;
    }
    let avx2 = has_avx2();
    let len = rows.len();
    #[cfg(target_arch = "x86_64")]
    if avx2 && acts.n == 1 {
        // SAFETY: `has_avx2` detected the features the kernel needs.
        return unsafe { crate::intdot_avx2::decode32(kind, rows, row_of, acts, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(level) = neon_level() {
        return crate::intdot_neon::matrix32(level, kind, rows, row_of, acts, out);
    }
    for (i, r) in rows.enumerate() {
        let row = row_of(r);
        for_groups(acts.n, len, i, out, |ts, part| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: `has_avx2` detected the features the kernel needs.
                return unsafe { crate::intdot_avx2::dots32(kind, &row, acts, ts, part) };
            }
            let _ = avx2;
            dots32_portable(kind, &row, acts, ts, part)
        });
    }
}

/// [`matrix32`] for a matrix of k-quant super-blocks stored row after row
/// in `data`.
pub fn matrix_k(
    kind: KindK,
    rows: Range<usize>,
    data: &[u8],
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    assert_eq!(acts.block, ActBlock::B256);
    let w = acts.cols / 256 * k_bytes(kind);
    let row_of = |r: usize| &data[r * w..(r + 1) * w];
    let (vnni, avx2) = (has_vnni(), has_avx2());
    #[cfg(target_arch = "x86_64")]
    if vnni && acts.n >= crate::INTGEMM_MIN_ROWS {
        return crate::intgemm::matrix_k(kind, rows, data, acts, out);
    }
    #[cfg(target_arch = "x86_64")]
    if vnni || avx2 {
        // SAFETY: `has_vnni` / `has_avx2` detected the features they need.
        return unsafe {
            if vnni {
                crate::intdot_avx2::rows_k_vnni(kind, rows, data, acts, out)
            } else {
                crate::intdot_avx2::rows_k(kind, rows, data, acts, out)
            }
        };
    }
    let _ = (vnni, avx2);
    #[cfg(target_arch = "aarch64")]
    if let Some(level) = neon_level() {
        return crate::intdot_neon::matrix_k(level, kind, rows, data, acts, out);
    }
    let len = rows.len();
    for (i, r) in rows.enumerate() {
        let row = row_of(r);
        for_groups(acts.n, len, i, out, |ts, part| {
            dots_k_portable(kind, row, acts, ts, part)
        });
    }
}

/// Calls `each(ts, part)` for consecutive groups `ts` of at most [`GROUP`]
/// activation rows, then scatters each group's outputs for weight row `i`
/// of the range into `out` (`[n, len]`).
#[inline(always)]
pub(crate) fn for_groups(
    n: usize,
    len: usize,
    i: usize,
    out: &mut [f32],
    mut each: impl FnMut(Range<usize>, &mut [f32]),
) {
    let mut part = [0f32; GROUP];
    for t0 in (0..n).step_by(GROUP) {
        let ts = t0..(t0 + GROUP).min(n);
        let k = ts.len();
        each(ts, &mut part[..k]);
        for (j, &v) in part[..k].iter().enumerate() {
            out[(t0 + j) * len + i] = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int8::Int8Matrix;
    use crate::kquant::{self, SuperBlockMatrix};
    use crate::legacy::{self, BlockMatrix};
    use crate::q4::Q4Matrix;
    use crate::q8_0::{self, Q8_0Matrix};
    use crate::testing::values;
    use crate::{matmul_with, Bytes, Precision, Rearranged, WeightMatrix};

    fn random_blocks(blocks: usize, bytes: usize, halves: &[usize], seed: u64) -> Bytes {
        Bytes::from_vec(crate::testing::random_blocks(blocks, bytes, halves, seed))
    }

    fn matrices(rows: usize, cols: usize) -> Vec<Box<dyn WeightMatrix>> {
        let b32 = rows * cols / 32;
        let b256 = rows * cols / 256;
        let f = crate::float::FloatMatrix::from_f32(&values(rows * cols, 3, 0.2), rows, cols)
            .expect("shape");
        let mut all: Vec<Box<dyn WeightMatrix>> = vec![
            Box::new(
                Q8_0Matrix::new(
                    Bytes::from_vec(q8_0::quantize(&values(rows * cols, 9, 0.3), cols)),
                    rows,
                    cols,
                )
                .expect("sizes"),
            ),
            Box::new(
                BlockMatrix::<legacy::Q4_0>::new(random_blocks(b32, 18, &[0], 11), rows, cols)
                    .expect("sizes"),
            ),
            Box::new(
                BlockMatrix::<legacy::Q4_1>::new(random_blocks(b32, 20, &[0, 2], 12), rows, cols)
                    .expect("sizes"),
            ),
            Box::new(
                BlockMatrix::<legacy::Q5_0>::new(random_blocks(b32, 22, &[0], 13), rows, cols)
                    .expect("sizes"),
            ),
            Box::new(
                BlockMatrix::<legacy::Q5_1>::new(random_blocks(b32, 24, &[0, 2], 14), rows, cols)
                    .expect("sizes"),
            ),
            Box::new(Int8Matrix::quantize(&f)),
            Box::new(Q4Matrix::quantize(&f).expect("width").0),
        ];
        if rows.is_multiple_of(crate::block32_x8::ROWS) {
            use crate::block32_x8::{Q4_0Rows8, Q5_0Rows8, Q8_0Rows8};
            let q8 = q8_0::quantize(&values(rows * cols, 9, 0.3), cols);
            let q4_0 = random_blocks(b32, 18, &[0], 11);
            let q5_0 = random_blocks(b32, 22, &[0], 13);
            all.push(Box::new(
                Q8_0Rows8::from_gguf(&q8, rows, cols).expect("sizes"),
            ));
            all.push(Box::new(
                Q4_0Rows8::from_gguf(q4_0.as_slice(), rows, cols).expect("sizes"),
            ));
            all.push(Box::new(
                Q5_0Rows8::from_gguf(q5_0.as_slice(), rows, cols).expect("sizes"),
            ));
        }
        // The k-quants' super-blocks span 256 columns.
        if cols.is_multiple_of(256) {
            let kquants: Vec<Box<dyn WeightMatrix>> = vec![
                Box::new(
                    SuperBlockMatrix::<kquant::Q4K>::new(
                        random_blocks(b256, 144, &[0, 2], 15),
                        rows,
                        cols,
                    )
                    .expect("sizes"),
                ),
                Box::new(
                    SuperBlockMatrix::<kquant::Q5K>::new(
                        random_blocks(b256, 176, &[0, 2], 16),
                        rows,
                        cols,
                    )
                    .expect("sizes"),
                ),
                Box::new(
                    SuperBlockMatrix::<kquant::Q6K>::new(
                        random_blocks(b256, 210, &[208], 17),
                        rows,
                        cols,
                    )
                    .expect("sizes"),
                ),
            ];
            all.extend(kquants);
            if rows.is_multiple_of(crate::kquant_x8::ROWS) {
                use crate::kquant_x8::{Q4KRows8, Q6KRows8};
                let q4k = random_blocks(b256, 144, &[0, 2], 15);
                let q6k = random_blocks(b256, 210, &[208], 17);
                all.push(Box::new(
                    Q4KRows8::from_gguf(q4k.as_slice(), rows, cols).expect("sizes"),
                ));
                all.push(Box::new(
                    Q6KRows8::from_gguf(q6k.as_slice(), rows, cols).expect("sizes"),
                ));
            }
        }
        all
    }

    /// The f64 product of the widened weights with the rounded activations
    /// widened back: what an integer kernel must compute, up to f32 rounding.
    fn reference(w: &dyn WeightMatrix, acts: &QuantizedActs) -> (Vec<f64>, Vec<f64>) {
        let (rows, cols) = (w.rows(), w.cols());
        let mut deq = vec![0f32; rows * cols];
        w.dequantize_rows(0..rows, &mut deq);
        let (mut y, mut mag) = (vec![0f64; acts.n * rows], vec![0f64; acts.n * rows]);
        for t in 0..acts.n {
            let x = acts.dequantize_row(t);
            for r in 0..rows {
                for c in 0..cols {
                    let p = f64::from(x[c]) * f64::from(deq[r * cols + c]);
                    y[t * rows + r] += p;
                    mag[t * rows + r] += p.abs();
                }
            }
        }
        (y, mag)
    }

    fn check(name: &str, got: f32, want: f64, mag: f64) {
        assert!(
            (f64::from(got) - want).abs() <= 2e-6 * mag + 1e-9,
            "{name}: {got} vs {want} (magnitude {mag})"
        );
    }

    #[test]
    fn integer_kernels_compute_the_product_with_rounded_activations() {
        // An even and an odd number of blocks per row (pairs of blocks and a
        // tail); rows in whole groups of eight for the interleaved Q4_K.
        for (rows, cols) in [(21, 512), (7, 544), (16, 768)] {
            check_integer_kernels(rows, cols);
        }
    }

    fn check_integer_kernels(rows: usize, cols: usize) {
        for w in matrices(rows, cols) {
            let k = w.integer().expect("an integer kernel");
            for n in [1, 2, 3, 4, 5, 8, 9, 17, 30] {
                let x = values(n * cols, n as u64 + 40, 2.0);
                let acts = QuantizedActs::quantize(&x, n, cols, k.act_block());
                let (want, mag) = reference(w.as_ref(), &acts);
                // The kernel chosen at run time, through the whole product
                // (which takes it for fewer than GEMM_MIN_ROWS rows).
                if n < crate::GEMM_MIN_ROWS || has_vnni() {
                    let y = matmul_with(w.as_ref(), &x, n, Precision::Int8Activations);
                    for (i, &got) in y.iter().enumerate() {
                        check(
                            &format!("{} n={n} [{i}]", w.storage()),
                            got,
                            want[i],
                            mag[i],
                        );
                    }
                }
                // Every row through `int_dots` on this thread, with the
                // kernel chosen at run time and with the portable one.
                for portable in [false, true] {
                    FORCE_PORTABLE.with(|f| f.set(portable));
                    let mut out = vec![0f32; n * rows];
                    k.int_dots(0..rows, &acts, &mut out);
                    FORCE_PORTABLE.with(|f| f.set(false));
                    for (i, &got) in out.iter().enumerate() {
                        let name = format!("{} portable={portable} n={n} [{i}]", w.storage());
                        check(&name, got, want[i], mag[i]);
                    }
                }
            }
        }
    }

    /// A row of a few-row product is the one-row product of that row, bit
    /// for bit, whatever the rows beside it: batched decode and verified
    /// drafts sample what a one-token step samples. (The AVX-512 VNNI
    /// few-row kernel still gathers four rows' sums before scaling, so it is
    /// held to this only through the AVX2 and portable levels.)
    #[test]
    fn each_row_of_a_few_row_product_is_its_one_row_product() {
        if has_vnni() {
            eprintln!("the VNNI few-row kernel is not row-independent yet; run at GEMMA4_KERNEL_LEVEL=avx2");
            return;
        }
        let (rows, cols) = (64, 512);
        for w in matrices(rows, cols) {
            for n in 2..crate::GEMM_MIN_ROWS {
                let x = values(n * cols, n as u64 + 60, 1.5);
                let together = matmul_with(w.as_ref(), &x, n, Precision::Int8Activations);
                for t in 0..n {
                    let alone = matmul_with(
                        w.as_ref(),
                        &x[t * cols..(t + 1) * cols],
                        1,
                        Precision::Int8Activations,
                    );
                    for (i, (a, b)) in together[t * rows..(t + 1) * rows]
                        .iter()
                        .zip(&alone)
                        .enumerate()
                    {
                        assert!(
                            a.to_bits() == b.to_bits(),
                            "{} n={n} row {t} [{i}]: {a} batched, {b} alone",
                            w.storage()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn several_matrices_in_one_product_give_each_alone() {
        // 256 rows: several chunks per matrix; every storage type, with
        // 32- and 256-value activation blocks side by side.
        let (rows, cols) = (256, 512);
        let all = matrices(rows, cols);
        let ws: Vec<&dyn WeightMatrix> = all.iter().map(|w| w.as_ref()).collect();
        for precision in [Precision::Exact, Precision::Int8Activations] {
            for n in [1, 3, crate::GEMM_MIN_ROWS + 1] {
                let x = values(n * cols, n as u64 + 90, 1.0);
                let together = crate::matmul_many(&ws, &x, n, precision);
                assert_eq!(together.len(), ws.len());
                for (w, y) in ws.iter().zip(&together) {
                    let alone = matmul_with(*w, &x, n, precision);
                    assert_eq!(y.len(), n * rows);
                    for (i, (a, b)) in y.iter().zip(&alone).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits(),
                            "{} {precision:?} n={n} [{i}]: {a} vs {b}",
                            w.storage()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rounded_activations_stay_close_to_the_exact_product() {
        let (rows, cols) = (16, 512);
        for w in matrices(rows, cols) {
            let x = values(2 * cols, 77, 1.0);
            let fast = matmul_with(w.as_ref(), &x, 2, Precision::Int8Activations);
            let exact = matmul_with(w.as_ref(), &x, 2, Precision::Exact);
            let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in fast.iter().zip(&exact) {
                // 8-bit activations: about 1% of the output's range.
                assert!((a - b).abs() <= 0.02 * scale, "{}: {a} vs {b}", w.storage());
            }
        }
    }
}
