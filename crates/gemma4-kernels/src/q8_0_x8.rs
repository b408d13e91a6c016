//! Q8_0 matrices rearranged at load, eight rows interleaved, for the AVX-512
//! VNNI kernel of the fast (8-bit activation) mode.
//!
//! Row by row, a kernel that multiplies one Q8_0 row by several activation
//! rows must sum each block's lanes for every pair of rows, and those sums
//! cost more than the multiplies: on a batched decode step (four sequences)
//! the demo's 262,144-row head ran at two thirds of the memory's rate. Here
//! each 32-value block column of eight rows is one block: the eight rows'
//! f16 scales side by side, then eight 32-byte units, unit `u` holding
//! values `4u..4u + 4` of each of the eight rows as unsigned bytes (`q + 128`).
//! One `vpdpbusd` multiplies a unit with four activation bytes broadcast to
//! every lane, so the eight rows' sums build up side by side in one
//! register, with no lane sums at all, and the scales are applied once per
//! block to all eight. The rearrangement is lossless: [`Q8_0Rows8::restore`]
//! gives a row's block back in GGUF's bytes, which the exact and fallback
//! paths use.

use std::ops::Range;

use crate::intdot;
use crate::q8_0::{Q8_0Matrix, BLOCK, BLOCK_BYTES};
use crate::{ActBlock, Bytes, IntegerDots, QuantizedActs, Rearranged, WeightMatrix};

/// Rows interleaved in one block.
pub const ROWS: usize = 8;
/// Bytes of one eight-row block: eight f16 scales, then eight units.
const GROUP_BLOCK_BYTES: usize = ROWS * BLOCK_BYTES;
/// Where the units start in a block.
const UNITS: usize = 2 * ROWS;

/// A `[rows, cols]` Q8_0 matrix with eight rows interleaved, in
/// [arena](crate::arena) memory.
#[derive(Debug)]
pub struct Q8_0Rows8 {
    store: crate::arena::Piece,
    /// Bytes of `store` the appended rows fill.
    filled: usize,
    rows: usize,
    cols: usize,
}

/// Writes GGUF block `src` (34 bytes) as row `r` of the eight-row block `dst`.
fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
    for (u, four) in src[2..].chunks_exact(4).enumerate() {
        let at = UNITS + 32 * u + 4 * r;
        for (d, &q) in dst[at..at + 4].iter_mut().zip(four) {
            *d = q ^ 0x80;
        }
    }
}

/// The inverse of [`pack`]: row `r` of block `src` as a GGUF block.
fn unpack(src: &[u8], r: usize, dst: &mut [u8]) {
    dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
    for (u, four) in dst[2..].chunks_exact_mut(4).enumerate() {
        let at = UNITS + 32 * u + 4 * r;
        for (d, &q) in four.iter_mut().zip(&src[at..at + 4]) {
            *d = q ^ 0x80;
        }
    }
}

impl Q8_0Rows8 {
    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The appended rows' blocks.
    fn blocks(&self) -> &[u8] {
        &self.store.as_slice()[..self.filled]
    }

    /// Block `b` of row `r` in GGUF's bytes (`out`: 34 bytes).
    pub fn restore(&self, r: usize, b: usize, out: &mut [u8]) {
        let at = ((r / ROWS) * self.blocks_per_row() + b) * GROUP_BLOCK_BYTES;
        unpack(&self.blocks()[at..at + GROUP_BLOCK_BYTES], r % ROWS, out);
    }

    /// Rows `rows` as a GGUF-layout matrix.
    fn restore_rows(&self, rows: Range<usize>) -> Q8_0Matrix {
        let per = self.blocks_per_row();
        let mut out = vec![0u8; rows.len() * per * BLOCK_BYTES];
        for (i, r) in rows.clone().enumerate() {
            let row = &mut out[i * per * BLOCK_BYTES..(i + 1) * per * BLOCK_BYTES];
            for (b, blk) in row.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                self.restore(r, b, blk);
            }
        }
        Q8_0Matrix::new(Bytes::from_vec(out), rows.len(), self.cols)
            .expect("restored rows have the matrix's width")
    }
}

impl Rearranged for Q8_0Rows8 {
    const NAME: &'static str = "Q8_0x8";
    const GROUP_ROWS: usize = ROWS;

    fn with_capacity(rows: usize, cols: usize) -> Option<Self> {
        (cols.is_multiple_of(BLOCK) && cols > 0 && rows.is_multiple_of(ROWS)).then(|| Self {
            store: crate::arena::alloc_zeroed(Self::bytes_for(rows, cols)),
            filled: 0,
            rows: 0,
            cols,
        })
    }

    fn bytes_for(rows: usize, cols: usize) -> usize {
        rows * cols / BLOCK * BLOCK_BYTES
    }

    fn append_gguf(&mut self, data: &[u8]) -> bool {
        let per = self.blocks_per_row();
        let group_bytes = ROWS * per * BLOCK_BYTES;
        if per == 0 || !data.len().is_multiple_of(group_bytes) {
            return false;
        }
        let groups = data.len() / group_bytes;
        let (start, end) = (self.filled, self.filled + groups * group_bytes);
        if end > self.store.len() {
            return false;
        }
        let fresh = &mut self.store.as_mut_slice()[start..end];
        crate::pool::global().for_each_chunk(fresh, group_bytes, &|g, out| {
            let src = &data[g * group_bytes..(g + 1) * group_bytes];
            for (b, dst) in out.chunks_exact_mut(GROUP_BLOCK_BYTES).enumerate() {
                for r in 0..ROWS {
                    let at = (r * per + b) * BLOCK_BYTES;
                    pack(&src[at..at + BLOCK_BYTES], r, dst);
                }
            }
        });
        self.filled = end;
        self.rows += groups * ROWS;
        true
    }
}

impl WeightMatrix for Q8_0Rows8 {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        Self::NAME
    }
    fn stored_bytes(&self) -> usize {
        self.filled
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.blocks())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let len = rows.len();
        self.restore_rows(rows).dequantize_rows(0..len, out)
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let len = rows.len();
        self.restore_rows(rows).dots(0..len, x, n, out)
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl IntegerDots for Q8_0Rows8 {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        assert_eq!(acts.block, ActBlock::B32);
        let len = rows.len();
        #[cfg(target_arch = "x86_64")]
        if intdot::has_vnni() {
            crate::in_whole_groups(rows, ROWS, acts.n, out, |groups, out| {
                // SAFETY: `has_vnni` detected the features the kernel needs.
                unsafe { avx512::dots(self, groups, acts, out) }
            });
            return;
        }
        // Elsewhere (the loader interleaves only where VNNI is present; tests
        // force this path): GGUF's bytes through the row kernels.
        let m = self.restore_rows(rows);
        m.int_dots(0..len, acts, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{Q8_0Rows8, GROUP_BLOCK_BYTES, ROWS, UNITS};
    use crate::q8_0::BLOCK;
    use crate::QuantizedActs;

    /// Activation rows that share each load of a weight unit.
    const T_MAX: usize = 8;

    /// `out[t · len + 8 · (g − groups.start) + r] = Σ_c acts[t, c] ·
    /// W[8g + r, c]` for the row groups `groups` (`len` = 8 · their count),
    /// up to [`T_MAX`] activation rows at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots(m: &Q8_0Rows8, groups: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        let (len, blocks) = (groups.len() * ROWS, m.blocks_per_row());
        assert!(out.len() >= acts.n * len && acts.cols == m.cols);
        assert!(groups.end * blocks * GROUP_BLOCK_BYTES <= m.filled);
        assert!(acts.scales.len() >= acts.n * blocks);
        // Σ (q + 128) · a = Σ q · a + 128 · Σ a: each block's sum starts from
        // −128 · Σ a, the same for every row group, so worked out once here.
        let starts: Vec<i32> = (0..acts.n * blocks)
            .map(|i| {
                let (t, b) = (i / blocks, i % blocks);
                -128 * (acts.sum16(t, 2 * b) + acts.sum16(t, 2 * b + 1))
            })
            .collect();
        for (i, g) in groups.enumerate() {
            let mut t0 = 0;
            while t0 < acts.n {
                let tn = T_MAX.min(acts.n - t0);
                // SAFETY (all arms): the features are enabled here; group `g`
                // lies inside the filled blocks, and rows `t0..t0 + tn` inside
                // the activations, their scales, `starts` and `out`, as
                // asserted above.
                let y: [[f32; ROWS]; T_MAX] = unsafe {
                    match tn {
                        1 => group_t::<1>(m, g, acts, &starts, t0),
                        2 => group_t::<2>(m, g, acts, &starts, t0),
                        3 => group_t::<3>(m, g, acts, &starts, t0),
                        4 => group_t::<4>(m, g, acts, &starts, t0),
                        5 => group_t::<5>(m, g, acts, &starts, t0),
                        6 => group_t::<6>(m, g, acts, &starts, t0),
                        7 => group_t::<7>(m, g, acts, &starts, t0),
                        _ => group_t::<8>(m, g, acts, &starts, t0),
                    }
                };
                for (k, y) in y.iter().enumerate().take(tn) {
                    let at = (t0 + k) * len + i * ROWS;
                    out[at..at + ROWS].copy_from_slice(y);
                }
                t0 += tn;
            }
        }
    }

    /// Row group `g` against the `T` activation rows from `t0`; `starts`
    /// holds each activation block's starting sum (`[n, blocks]`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn group_t<const T: usize>(
        m: &Q8_0Rows8,
        g: usize,
        acts: &QuantizedActs,
        starts: &[i32],
        t0: usize,
    ) -> [[f32; ROWS]; T_MAX] {
        let blocks = m.blocks_per_row();
        let base = m.blocks().as_ptr().add(g * blocks * GROUP_BLOCK_BYTES);
        let qs: [*const u8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr().cast());
        let first: [*const i32; T] =
            std::array::from_fn(|k| starts.as_ptr().add((t0 + k) * blocks));
        let scales: [*const f32; T] =
            std::array::from_fn(|k| acts.scales.as_ptr().add((t0 + k) * blocks));
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            let blk = base.add(b * GROUP_BLOCK_BYTES);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            let mut isum: [__m256i; T] =
                std::array::from_fn(|k| _mm256_set1_epi32(*first[k].add(b)));
            for u in 0..BLOCK / 4 {
                let w = _mm256_loadu_si256(blk.add(UNITS + 32 * u).cast());
                for k in 0..T {
                    let four = qs[k].add(BLOCK * b + 4 * u).cast::<i32>().read_unaligned();
                    isum[k] = _mm256_dpbusd_epi32(isum[k], w, _mm256_set1_epi32(four));
                }
            }
            for k in 0..T {
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*scales[k].add(b)));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k]), d, acc[k]);
            }
        }
        let mut y = [[0f32; ROWS]; T_MAX];
        for k in 0..T {
            _mm256_storeu_ps(y[k].as_mut_ptr(), acc[k]);
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_0;
    use crate::testing::values;

    #[test]
    fn interleaving_restores_every_byte() {
        let (rows, cols) = (24, 96);
        let gguf = q8_0::quantize(&values(rows * cols, 5, 1.0), cols);
        let m = Q8_0Rows8::from_gguf(&gguf, rows, cols).expect("whole groups");
        assert_eq!(m.stored_bytes(), gguf.len());
        let mut blk = [0u8; BLOCK_BYTES];
        for r in 0..rows {
            for b in 0..cols / BLOCK {
                m.restore(r, b, &mut blk);
                let at = (r * cols / BLOCK + b) * BLOCK_BYTES;
                assert_eq!(&blk[..], &gguf[at..at + BLOCK_BYTES], "row {r} block {b}");
            }
        }
        // Not whole groups of eight rows, or the wrong length: refused.
        assert!(Q8_0Rows8::from_gguf(&gguf[..gguf.len() / 24 * 4], 4, cols).is_none());
        assert!(Q8_0Rows8::from_gguf(&gguf[1..], rows, cols).is_none());
    }

    /// Every product of the interleaved matrix equals the GGUF-layout
    /// matrix's within the integer kernels' rounding, for ranges that cut
    /// groups and activation row counts on both sides of the kernel's
    /// eight-row step; the exact path agrees to the bit.
    #[test]
    fn interleaved_products_match_the_gguf_layout() {
        let (rows, cols) = (40, 160);
        let gguf = q8_0::quantize(&values(rows * cols, 9, 1.0), cols);
        let plain = Q8_0Matrix::new(Bytes::from_vec(gguf.clone()), rows, cols).expect("sizes");
        let x8 = Q8_0Rows8::from_gguf(&gguf, rows, cols).expect("whole groups");
        for n in [1, 3, 4, 8, 9, 17] {
            let x = values(n * cols, 30 + n as u64, 2.0);
            let acts = QuantizedActs::quantize(&x, n, cols, ActBlock::B32);
            for range in [0..rows, 8..24, 3..29, 33..40] {
                let len = range.len();
                let mut want = vec![0f32; n * len];
                let mut got = vec![0f32; n * len];
                // The reference: exact integer sums, block by block.
                for t in 0..n {
                    for (i, r) in range.clone().enumerate() {
                        let mut sum = 0f64;
                        let row = &gguf[r * cols / BLOCK * BLOCK_BYTES..];
                        for b in 0..cols / BLOCK {
                            let blk = &row[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                            let d = crate::f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
                            let dot: i32 = (0..BLOCK)
                                .map(|c| {
                                    i32::from(blk[2 + c] as i8)
                                        * i32::from(acts.row(t)[b * BLOCK + c])
                                })
                                .sum();
                            sum += f64::from(d) * f64::from(acts.scale(t, b)) * f64::from(dot);
                        }
                        want[t * len + i] = sum as f32;
                    }
                }
                x8.int_dots(range.clone(), &acts, &mut got);
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "n={n} {range:?} [{i}]: {g} vs {w}"
                    );
                }
                let mut exact_plain = vec![0f32; n * len];
                let mut exact_x8 = vec![0f32; n * len];
                plain.dots(range.clone(), &x, n, &mut exact_plain);
                x8.dots(range.clone(), &x, n, &mut exact_x8);
                assert_eq!(exact_plain, exact_x8, "exact n={n} {range:?}");
            }
        }
        let mut a = vec![0f32; 2 * cols];
        let mut b = vec![0f32; 2 * cols];
        plain.dequantize_rows(5..7, &mut a);
        x8.dequantize_rows(5..7, &mut b);
        assert_eq!(a, b);
    }
}
