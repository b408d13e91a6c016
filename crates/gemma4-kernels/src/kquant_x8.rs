//! Q4_K matrices rearranged at load, eight rows interleaved, for the
//! AVX-512 VNNI kernel of the fast (8-bit activation) mode.
//!
//! In GGUF's layout a Q4_K row reads as 144-byte super-blocks, and a kernel
//! spends most of its time per super-block unpacking the twelve bytes of
//! 6-bit scales and mins and summing one row's lanes: on a decode step it
//! runs below the memory's rate. Here each super-block column of eight rows
//! is one 1184-byte block: the eight `d` and `dmin`, the scales and mins as
//! plain bytes ordered by sub-block then row, and the nibbles in 32-byte
//! units that hold four consecutive values of each of the eight rows. One
//! `vpdpbusd` multiplies such a unit with four activation bytes broadcast to
//! every lane, so the eight rows' sums build up side by side in one
//! register, and the scales are applied once per sub-block to all eight.
//! The rearrangement is lossless: [`Q4KRows8::restore`] gives a row's
//! super-block back in GGUF's bytes, which the exact and fallback paths
//! use.

use std::ops::Range;

use crate::intdot::{self, KindK};
use crate::kquant::{self, SuperBlock as _, SUPER};
use crate::{ActBlock, IntegerDots, QuantizedActs, WeightMatrix};

/// Rows interleaved in one block.
pub const ROWS: usize = 8;
/// Bytes of one Q4_K super-block in GGUF's layout.
const Q4K_BYTES: usize = 144;
/// Offsets within an eight-row block: eight f16 `d`, eight f16 `dmin`,
/// scales `[sub-block j][row]`, mins `[j / 2][row][j % 2]`, nibbles.
const D: usize = 0;
const DMIN: usize = 16;
const SCALES: usize = 32;
const MINS: usize = 96;
const QS: usize = 160;
/// Bytes of one eight-row block.
pub const BLOCK_BYTES: usize = QS + ROWS * 128;

/// A `[rows, cols]` Q4_K matrix (`rows` a multiple of [`ROWS`]) held as
/// eight-row blocks: row group after row group, each group's super-blocks
/// in column order.
#[derive(Debug, Clone)]
pub struct Q4KRows8 {
    blocks: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl Q4KRows8 {
    /// Rearranges GGUF's Q4_K bytes; `None` when the sizes disagree or the
    /// rows do not fill whole groups of eight.
    pub fn from_q4k(data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let supers = cols / SUPER;
        let fits = cols.is_multiple_of(SUPER)
            && rows.is_multiple_of(ROWS)
            && data.len() == rows * supers * Q4K_BYTES;
        if !fits {
            return None;
        }
        let mut blocks = vec![0u8; rows / ROWS * supers * BLOCK_BYTES];
        for (g, group) in blocks.chunks_exact_mut(supers * BLOCK_BYTES).enumerate() {
            for (s, dst) in group.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                for r in 0..ROWS {
                    let at = ((g * ROWS + r) * supers + s) * Q4K_BYTES;
                    pack(&data[at..at + Q4K_BYTES], r, dst);
                }
            }
        }
        Some(Self { blocks, rows, cols })
    }

    fn supers(&self) -> usize {
        self.cols / SUPER
    }

    /// The eight-row block of row group `g`, super-block `s`.
    fn block(&self, g: usize, s: usize) -> &[u8] {
        let at = (g * self.supers() + s) * BLOCK_BYTES;
        &self.blocks[at..at + BLOCK_BYTES]
    }

    /// Super-block `s` of row `r` in GGUF's Q4_K bytes.
    pub fn restore(&self, r: usize, s: usize, out: &mut [u8; Q4K_BYTES]) {
        unpack(self.block(r / ROWS, s), r % ROWS, out);
    }

    /// Rows `rows` in GGUF's Q4_K bytes, row after row.
    fn restore_rows(&self, rows: Range<usize>) -> Vec<u8> {
        let supers = self.supers();
        let mut out = vec![0u8; rows.len() * supers * Q4K_BYTES];
        for (blk, (r, s)) in out
            .chunks_exact_mut(Q4K_BYTES)
            .zip(rows.flat_map(|r| (0..supers).map(move |s| (r, s))))
        {
            let blk: &mut [u8; Q4K_BYTES] = blk.try_into().expect("144-byte chunks");
            self.restore(r, s, blk);
        }
        out
    }
}

/// Writes GGUF super-block `src` as row `r` of the eight-row block `dst`.
fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
    dst[D + 2 * r..D + 2 * r + 2].copy_from_slice(&src[0..2]);
    dst[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&src[2..4]);
    for j in 0..8 {
        let (sc, mn) = intdot::scale_min(j, &src[4..16]);
        dst[SCALES + ROWS * j + r] = sc as u8;
        dst[MINS + 2 * ROWS * (j / 2) + 2 * r + j % 2] = mn as u8;
    }
    // Unit (m, t) holds, for each row, the nibble bytes 4t..4t+4 of the
    // row's sub-block pair m: values 64m + 4t.. (low nibbles) and
    // 64m + 32 + 4t.. (high nibbles).
    for m in 0..4 {
        for t in 0..8 {
            let from = 16 + 32 * m + 4 * t;
            let to = QS + 32 * (8 * m + t) + 4 * r;
            dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
        }
    }
}

/// The inverse of [`pack`]: row `r` of block `src` in GGUF's bytes.
fn unpack(src: &[u8], r: usize, dst: &mut [u8; Q4K_BYTES]) {
    dst[0..2].copy_from_slice(&src[D + 2 * r..D + 2 * r + 2]);
    dst[2..4].copy_from_slice(&src[DMIN + 2 * r..DMIN + 2 * r + 2]);
    let sc = |j: usize| src[SCALES + ROWS * j + r];
    let mn = |j: usize| src[MINS + 2 * ROWS * (j / 2) + 2 * r + j % 2];
    // GGUF's twelve bytes: scales and mins 0–3 in the low six bits of
    // bytes 0–7, 4–7 as nibbles of bytes 8–11 with their top two bits in
    // the top bits of bytes 0–7 (see `intdot::scale_min`).
    for j in 0..4 {
        dst[4 + j] = sc(j) | ((sc(j + 4) >> 4) << 6);
        dst[8 + j] = mn(j) | ((mn(j + 4) >> 4) << 6);
        dst[12 + j] = (sc(j + 4) & 0xF) | ((mn(j + 4) & 0xF) << 4);
    }
    for m in 0..4 {
        for t in 0..8 {
            let to = 16 + 32 * m + 4 * t;
            let from = QS + 32 * (8 * m + t) + 4 * r;
            dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
        }
    }
}

impl WeightMatrix for Q4KRows8 {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        "Q4_Kx8"
    }
    fn stored_bytes(&self) -> usize {
        self.blocks.len()
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let mut blk = [0u8; Q4K_BYTES];
        let mut values = [0f32; SUPER];
        for (i, r) in rows.enumerate() {
            let o = &mut out[i * self.cols..(i + 1) * self.cols];
            for (s, ob) in o.chunks_exact_mut(SUPER).enumerate() {
                self.restore(r, s, &mut blk);
                kquant::Q4K::decode(&blk, &mut values);
                ob.copy_from_slice(&values);
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        for (i, r) in rows.enumerate() {
            let row = self.restore_rows(r..r + 1);
            for t in 0..n {
                out[t * len + i] = kquant::dot_q4k(&x[t * cols..(t + 1) * cols], &row);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl IntegerDots for Q4KRows8 {
    fn act_block(&self) -> ActBlock {
        ActBlock::B256
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        assert_eq!(acts.block, ActBlock::B256);
        #[cfg(target_arch = "x86_64")]
        if intdot::has_vnni() {
            let (n, len) = (acts.n, rows.len());
            let groups = rows.start / ROWS..rows.end.div_ceil(ROWS);
            if rows.start.is_multiple_of(ROWS) && rows.end.is_multiple_of(ROWS) {
                // SAFETY: `has_vnni` detected the features the kernel needs.
                unsafe { avx512::dots(self, groups, acts, out) };
            } else {
                // A range that cuts a group: the whole groups, then the rows asked for.
                let wide = groups.len() * ROWS;
                let mut all = vec![0f32; n * wide];
                let skip = rows.start - groups.start * ROWS;
                // SAFETY: as above.
                unsafe { avx512::dots(self, groups, acts, &mut all) };
                for t in 0..n {
                    out[t * len..(t + 1) * len]
                        .copy_from_slice(&all[t * wide + skip..t * wide + skip + len]);
                }
            }
            return;
        }
        // Elsewhere (the loader interleaves only where VNNI is present; tests
        // force this path): GGUF's bytes through the k-quant kernels.
        let data = self.restore_rows(rows.clone());
        intdot::matrix_k(KindK::Q4K, 0..rows.len(), &data, acts, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{Q4KRows8, BLOCK_BYTES, D, DMIN, MINS, QS, ROWS, SCALES};
    use crate::intdot::GROUP;
    use crate::QuantizedActs;

    /// `out[t · len + 8 · (g − groups.start) + r] = Σ_c acts[t, c] ·
    /// W[8g + r, c]` for the row groups `groups` (`len` = 8 · their count),
    /// [`GROUP`] activation rows at a time, each weight block unpacked once
    /// for all of them.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots(m: &Q4KRows8, groups: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        let supers = m.supers();
        // Σ q over each 32 activations, two sub-blocks' sums as i16 halves
        // of one word (`vpmaddwd` against a row's two mins): [n, supers, 4].
        let mut pairs = vec![0i32; acts.n * supers * 4];
        for (t, row) in pairs.chunks_exact_mut(supers * 4).enumerate() {
            for (p, w) in row.iter_mut().enumerate() {
                let g = |j: usize| acts.sum16(t, 2 * j) + acts.sum16(t, 2 * j + 1);
                let (lo, hi) = (g(2 * p), g(2 * p + 1));
                *w = (lo & 0xFFFF) | (hi << 16);
            }
        }
        let len = groups.len() * ROWS;
        for t0 in (0..acts.n).step_by(GROUP) {
            for (i, g) in groups.clone().enumerate() {
                let o = out[t0 * len + i * ROWS..].as_mut_ptr();
                match (acts.n - t0).min(GROUP) {
                    1 => group_t::<1>(m, g, acts, &pairs, t0, o, len),
                    2 => group_t::<2>(m, g, acts, &pairs, t0, o, len),
                    3 => group_t::<3>(m, g, acts, &pairs, t0, o, len),
                    _ => group_t::<4>(m, g, acts, &pairs, t0, o, len),
                }
            }
        }
    }

    /// Row group `g` against the `T` activation rows from `t0`; the eight
    /// sums of row `t0 + k` go to `out + k · len`.
    #[inline(always)]
    unsafe fn group_t<const T: usize>(
        m: &Q4KRows8,
        g: usize,
        acts: &QuantizedActs,
        pairs: &[i32],
        t0: usize,
        out: *mut f32,
        len: usize,
    ) {
        let supers = m.supers();
        let low = _mm256_set1_epi8(0x0F);
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        let qs: [*const u8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr() as *const u8);
        let mut acc = [_mm256_setzero_ps(); T];
        let base = m.blocks[g * supers * BLOCK_BYTES..].as_ptr();
        for s in 0..supers {
            let blk = base.add(s * BLOCK_BYTES);
            // Four activation bytes (values at `at`..`at + 4`) in every lane.
            let bcast = |k: usize, at: usize| {
                _mm256_set1_epi32((qs[k].add(256 * s + at) as *const i32).read_unaligned())
            };
            let mut sum = [_mm256_setzero_si256(); T];
            for p in 0..4 {
                // Sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles, kept
                // at 16× their level: no shift per unit, one per sum).
                let mut lo = [_mm256_setzero_si256(); T];
                let mut hi = [_mm256_setzero_si256(); T];
                for u in 0..8 {
                    let w = _mm256_loadu_si256(blk.add(QS + 32 * (8 * p + u)) as *const __m256i);
                    let (wl, wh) = (_mm256_and_si256(w, low), _mm256_and_si256(w, high));
                    for k in 0..T {
                        lo[k] = _mm256_dpbusd_epi32(lo[k], wl, bcast(k, 64 * p + 4 * u));
                        hi[k] = _mm256_dpbusd_epi32(hi[k], wh, bcast(k, 64 * p + 32 + 4 * u));
                    }
                }
                let scale = |j: usize| {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        blk.add(SCALES + ROWS * j) as *const __m128i
                    ))
                };
                let (s0, s1) = (scale(2 * p), scale(2 * p + 1));
                for k in 0..T {
                    let h = _mm256_srai_epi32(hi[k], 4);
                    sum[k] = _mm256_add_epi32(sum[k], _mm256_mullo_epi32(lo[k], s0));
                    sum[k] = _mm256_add_epi32(sum[k], _mm256_mullo_epi32(h, s1));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(D) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(DMIN) as *const __m128i));
            let mins: [__m256i; 4] = std::array::from_fn(|p| {
                _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    blk.add(MINS + 2 * ROWS * p) as *const __m128i
                ))
            });
            for k in 0..T {
                let t = t0 + k;
                let pair = pairs.as_ptr().add((t * supers + s) * 4);
                let mut by_min = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(*pair));
                for (p, &mn) in mins.iter().enumerate().skip(1) {
                    let gp = _mm256_set1_epi32(*pair.add(p));
                    by_min = _mm256_add_epi32(by_min, _mm256_madd_epi16(mn, gp));
                }
                let da = _mm256_set1_ps(acts.scale(t, s));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k]), _mm256_mul_ps(d, da), acc[k]);
                acc[k] =
                    _mm256_fnmadd_ps(_mm256_cvtepi32_ps(by_min), _mm256_mul_ps(dmin, da), acc[k]);
            }
        }
        for (k, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(k * len), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    /// Random Q4_K bytes with sane f16 scales.
    fn q4k_bytes(blocks: usize, seed: u64) -> Vec<u8> {
        let raw = values(blocks * Q4K_BYTES, seed, 1.0);
        let mut out: Vec<u8> = raw.iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
        let scales = values(blocks * 2, seed + 1, 0.05);
        for (b, blk) in out.chunks_exact_mut(Q4K_BYTES).enumerate() {
            for k in 0..2 {
                let h = half::f16::from_f32(scales[2 * b + k]).to_le_bytes();
                blk[2 * k..2 * k + 2].copy_from_slice(&h);
            }
        }
        out
    }

    #[test]
    fn interleaving_restores_every_byte() {
        let (rows, cols) = (16, 768);
        let data = q4k_bytes(rows * cols / SUPER, 5);
        let m = Q4KRows8::from_q4k(&data, rows, cols).expect("sizes");
        assert_eq!(m.restore_rows(0..rows), data);
        assert!(Q4KRows8::from_q4k(&data[..data.len() - Q4K_BYTES], rows, cols).is_none());
        assert!(Q4KRows8::from_q4k(&data, rows / 2 + 1, cols).is_none());
    }

    #[test]
    fn interleaved_products_match_the_gguf_layout() {
        let (rows, cols) = (24, 512);
        let data = q4k_bytes(rows * cols / SUPER, 9);
        let m = Q4KRows8::from_q4k(&data, rows, cols).expect("sizes");
        let gguf =
            kquant::SuperBlockMatrix::<kquant::Q4K>::new(crate::Bytes::from_vec(data), rows, cols)
                .expect("sizes");
        let (mut a, mut b) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
        m.dequantize_rows(0..rows, &mut a);
        gguf.dequantize_rows(0..rows, &mut b);
        assert_eq!(a, b);
        for n in [1, 2, 3, 4, 5, 9] {
            // The same integer sums, added up in another order.
            let x = values(n * cols, n as u64, 2.0);
            let acts = QuantizedActs::quantize(&x, n, cols, ActBlock::B256);
            // Whole groups, and ranges that cut them.
            for rows in [0..rows, 8..16, 3..21, 9..10] {
                let len = rows.len();
                let (mut got, mut want) = (vec![0f32; n * len], vec![0f32; n * len]);
                m.int_dots(rows.clone(), &acts, &mut got);
                gguf.int_dots(rows.clone(), &acts, &mut want);
                let scale = want.iter().fold(1f32, |a, w| a.max(w.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let tol = 1e-5 * scale;
                    assert!(
                        (g - w).abs() <= tol,
                        "n={n} rows {rows:?} [{i}]: {g} vs {w}"
                    );
                }
            }
            let exact = crate::matmul(&m, &x, n);
            assert_eq!(exact, crate::matmul(&gguf, &x, n), "n={n} exact");
        }
    }
}
