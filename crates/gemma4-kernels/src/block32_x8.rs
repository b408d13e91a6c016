//! Q8_0, Q4_0 and Q5_0 matrices rearranged at load, eight rows
//! interleaved, for the AVX-512 VNNI kernel of the fast (8-bit activation)
//! mode.
//!
//! Row by row, a kernel that multiplies one 32-value block row by
//! activations must sum each block's lanes for every pair of rows, and
//! those sums cost more than the multiplies: on a batched decode step (four
//! sequences) the demo's 262,144-row Q8_0 head ran at two thirds of the
//! memory's rate. Here each 32-value block column of eight rows is one
//! block: the eight rows' f16 scales side by side, then the levels as
//! eight 32-byte units, unit `u` holding values `4u..4u + 4` of each of the
//! eight rows as unsigned bytes (the level plus the format's offset). One
//! `vpdpbusd` multiplies a unit with four activation bytes broadcast to
//! every lane, so the eight rows' sums build up side by side in one
//! register, with no lane sums at all; the offset comes off once per block
//! through the activations' block sums, and the scales are applied once
//! per block to all eight rows.
//!
//! The 4- and 5-bit formats keep their size: a unit is unpacked in
//! registers from GGUF's own nibble bytes (bytes `4j..4j + 4` of each row
//! hold units `j` in their low nibbles and `j + 4` in their high ones), and
//! Q5_0's fifth bits are stored per unit as a 32-bit mask, one bit per
//! byte lane. The rearrangement is lossless: [`Rows8x32::restore`] gives a
//! row's block back in GGUF's bytes, which the exact and fallback paths use.

use std::marker::PhantomData;
use std::ops::Range;

use crate::intdot::Kind32;
use crate::legacy::{self, BlockMatrix};
use crate::q8_0::Q8_0Matrix;
use crate::{ActBlock, Bytes, IntegerDots, QuantizedActs, Rearranged, WeightMatrix};

/// Rows interleaved in one block.
pub const ROWS: usize = 8;
/// Values per block.
const BLOCK: usize = 32;
/// Where the levels start in an eight-row block (after eight f16 scales).
const LEVELS: usize = 2 * ROWS;

/// A 32-value block format's eight-row block.
pub trait Layout32: Send + Sync + std::fmt::Debug + 'static {
    /// Storage name in reports.
    const NAME: &'static str;
    /// The format as the row kernels know it.
    const KIND: Kind32;
    /// Bytes of one GGUF block (an eight-row block takes eight times this).
    const GGUF_BYTES: usize = Self::KIND.bytes();
    /// What each stored byte is above the signed level it encodes.
    const OFFSET: i32;
    /// Writes the levels of GGUF block `src` as row `r` of the block `dst`
    /// (the scale is placed by the caller).
    fn pack(src: &[u8], r: usize, dst: &mut [u8]);
    /// The inverse of [`Layout32::pack`].
    fn unpack(src: &[u8], r: usize, dst: &mut [u8]);
    /// Rows in GGUF's bytes as this format's row-major matrix.
    fn gguf_matrix(bytes: Bytes, rows: usize, cols: usize) -> Option<Box<dyn WeightMatrix>>;
}

/// Q8_0: eight units of `q + 128`.
#[derive(Debug)]
pub struct Q8_0x8;
impl Layout32 for Q8_0x8 {
    const NAME: &'static str = "Q8_0x8";
    const KIND: Kind32 = Kind32::Q8_0;
    const OFFSET: i32 = 128;
    fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
        for (u, four) in src[2..].chunks_exact(4).enumerate() {
            let at = LEVELS + 32 * u + 4 * r;
            for (d, &q) in dst[at..at + 4].iter_mut().zip(four) {
                *d = q ^ 0x80;
            }
        }
    }
    fn unpack(src: &[u8], r: usize, dst: &mut [u8]) {
        for (u, four) in dst[2..].chunks_exact_mut(4).enumerate() {
            let at = LEVELS + 32 * u + 4 * r;
            for (d, &q) in four.iter_mut().zip(&src[at..at + 4]) {
                *d = q ^ 0x80;
            }
        }
    }
    fn gguf_matrix(bytes: Bytes, rows: usize, cols: usize) -> Option<Box<dyn WeightMatrix>> {
        Some(Box::new(Q8_0Matrix::new(bytes, rows, cols)?))
    }
}

/// Moves row `r`'s sixteen nibble bytes (`qs`) into or out of the four
/// 32-byte nibble units of an eight-row block.
fn nibbles(r: usize, mut copy: impl FnMut(usize, usize)) {
    for j in 0..4 {
        copy(4 * j, LEVELS + 32 * j + 4 * r);
    }
}

/// Q4_0: four units of GGUF's nibble bytes (levels `q`, 0–15, for `q − 8`).
#[derive(Debug)]
pub struct Q4_0x8;
impl Layout32 for Q4_0x8 {
    const NAME: &'static str = "Q4_0x8";
    const KIND: Kind32 = Kind32::Q4_0;
    const OFFSET: i32 = 8;
    fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
        nibbles(r, |at, to| {
            dst[to..to + 4].copy_from_slice(&src[2 + at..2 + at + 4])
        });
    }
    fn unpack(src: &[u8], r: usize, dst: &mut [u8]) {
        nibbles(r, |at, from| {
            dst[2 + at..2 + at + 4].copy_from_slice(&src[from..from + 4])
        });
    }
    fn gguf_matrix(bytes: Bytes, rows: usize, cols: usize) -> Option<Box<dyn WeightMatrix>> {
        Some(Box::new(BlockMatrix::<legacy::Q4_0>::new(
            bytes, rows, cols,
        )?))
    }
}

/// Q5_0: four units of GGUF's nibble bytes, then eight 32-bit masks: bit
/// `4r + i` of mask `u` is the fifth bit of value `4u + i` of row `r`
/// (levels `q`, 0–31, for `q − 16`).
#[derive(Debug)]
pub struct Q5_0x8;
/// Where Q5_0's masks start in an eight-row block.
const MASKS: usize = LEVELS + 4 * 32;
impl Layout32 for Q5_0x8 {
    const NAME: &'static str = "Q5_0x8";
    const KIND: Kind32 = Kind32::Q5_0;
    const OFFSET: i32 = 16;
    fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
        nibbles(r, |at, to| {
            dst[to..to + 4].copy_from_slice(&src[6 + at..6 + at + 4])
        });
        let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
        // Row r's four bits of mask u are nibble r % 2 of its byte r / 2.
        let shift = 4 * (r % 2);
        for u in 0..8 {
            let bits = ((qh >> (4 * u)) & 0xF) as u8;
            let byte = &mut dst[MASKS + 4 * u + r / 2];
            *byte = (*byte & !(0xF << shift)) | (bits << shift);
        }
    }
    fn unpack(src: &[u8], r: usize, dst: &mut [u8]) {
        nibbles(r, |at, from| {
            dst[6 + at..6 + at + 4].copy_from_slice(&src[from..from + 4])
        });
        let shift = 4 * (r % 2);
        let qh = (0..8).fold(0u32, |qh, u| {
            let bits = u32::from((src[MASKS + 4 * u + r / 2] >> shift) & 0xF);
            qh | bits << (4 * u)
        });
        dst[2..6].copy_from_slice(&qh.to_le_bytes());
    }
    fn gguf_matrix(bytes: Bytes, rows: usize, cols: usize) -> Option<Box<dyn WeightMatrix>> {
        Some(Box::new(BlockMatrix::<legacy::Q5_0>::new(
            bytes, rows, cols,
        )?))
    }
}

/// A `[rows, cols]` matrix of 32-value blocks of layout `L` (`rows` a
/// multiple of [`ROWS`]) held as eight-row blocks, row group after row
/// group, in [arena](crate::arena) memory.
#[derive(Debug)]
pub struct Rows8x32<L> {
    store: crate::arena::Piece,
    /// Bytes of `store` the appended rows fill.
    filled: usize,
    rows: usize,
    cols: usize,
    layout: PhantomData<L>,
}

/// Q8_0 with eight rows interleaved.
pub type Q8_0Rows8 = Rows8x32<Q8_0x8>;
/// Q4_0 with eight rows interleaved.
pub type Q4_0Rows8 = Rows8x32<Q4_0x8>;
/// Q5_0 with eight rows interleaved.
pub type Q5_0Rows8 = Rows8x32<Q5_0x8>;

impl<L: Layout32> Rows8x32<L> {
    const GROUP_BLOCK_BYTES: usize = ROWS * L::GGUF_BYTES;

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The appended rows' blocks.
    fn blocks(&self) -> &[u8] {
        &self.store.as_slice()[..self.filled]
    }

    /// Block `b` of row `r` in GGUF's bytes (`out`: one GGUF block).
    pub fn restore(&self, r: usize, b: usize, out: &mut [u8]) {
        let at = ((r / ROWS) * self.blocks_per_row() + b) * Self::GROUP_BLOCK_BYTES;
        let src = &self.blocks()[at..at + Self::GROUP_BLOCK_BYTES];
        let r = r % ROWS;
        out[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
        L::unpack(src, r, out);
    }

    /// Rows `rows` as a GGUF-layout matrix.
    fn restore_rows(&self, rows: Range<usize>) -> Box<dyn WeightMatrix> {
        let (per, bytes) = (self.blocks_per_row(), L::GGUF_BYTES);
        let mut out = vec![0u8; rows.len() * per * bytes];
        for (i, r) in rows.clone().enumerate() {
            let row = &mut out[i * per * bytes..(i + 1) * per * bytes];
            for (b, blk) in row.chunks_exact_mut(bytes).enumerate() {
                self.restore(r, b, blk);
            }
        }
        L::gguf_matrix(Bytes::from_vec(out), rows.len(), self.cols)
            .expect("restored rows have the matrix's width")
    }
}

impl<L: Layout32> Rearranged for Rows8x32<L> {
    const NAME: &'static str = L::NAME;
    const GROUP_ROWS: usize = ROWS;

    fn with_capacity(rows: usize, cols: usize) -> Option<Self> {
        (cols.is_multiple_of(BLOCK) && cols > 0 && rows.is_multiple_of(ROWS)).then(|| Self {
            store: crate::arena::alloc_zeroed(Self::bytes_for(rows, cols)),
            filled: 0,
            rows: 0,
            cols,
            layout: PhantomData,
        })
    }

    fn bytes_for(rows: usize, cols: usize) -> usize {
        rows * cols / BLOCK * L::GGUF_BYTES
    }

    fn append_gguf(&mut self, data: &[u8]) -> bool {
        let (per, bytes) = (self.blocks_per_row(), L::GGUF_BYTES);
        let group_bytes = ROWS * per * bytes;
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
            for (b, dst) in out.chunks_exact_mut(Self::GROUP_BLOCK_BYTES).enumerate() {
                for r in 0..ROWS {
                    let at = (r * per + b) * bytes;
                    let blk = &src[at..at + bytes];
                    dst[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                    L::pack(blk, r, dst);
                }
            }
        });
        self.filled = end;
        self.rows += groups * ROWS;
        true
    }
}

impl<L: Layout32> WeightMatrix for Rows8x32<L> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        L::NAME
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

impl<L: Layout32> IntegerDots for Rows8x32<L> {
    fn act_block(&self) -> ActBlock {
        ActBlock::B32
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        assert_eq!(acts.block, ActBlock::B32);
        let len = rows.len();
        #[cfg(target_arch = "x86_64")]
        if crate::intdot::has_vnni() {
            crate::in_whole_groups(rows, ROWS, acts.n, out, |groups, out| {
                // SAFETY: `has_vnni` detected the features the kernel needs.
                unsafe { avx512::dots(self, groups, acts, out) }
            });
            return;
        }
        // Elsewhere (the loader interleaves only where VNNI is present; tests
        // force this path): GGUF's bytes through the row kernels.
        let m = self.restore_rows(rows);
        m.integer()
            .expect("32-value block formats have integer kernels")
            .int_dots(0..len, acts, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{Layout32, Rows8x32, BLOCK, LEVELS, MASKS, ROWS};
    use crate::intdot::Kind32;
    use crate::QuantizedActs;

    /// Activation rows that share each load of a weight unit.
    const T_MAX: usize = 8;
    /// Activation rows at a time when two row groups share each broadcast
    /// (the registers hold four rows' sums for both groups).
    const T_PAIR: usize = 4;

    /// `out[t · len + 8 · (g − groups.start) + r] = Σ_c acts[t, c] ·
    /// W[8g + r, c]` for the row groups `groups` (`len` = 8 · their count),
    /// up to [`T_MAX`] activation rows at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots<L: Layout32>(
        m: &Rows8x32<L>,
        groups: Range<usize>,
        acts: &QuantizedActs,
        out: &mut [f32],
    ) {
        let (len, blocks) = (groups.len() * ROWS, m.blocks_per_row());
        assert!(out.len() >= acts.n * len && acts.cols == m.cols);
        assert!(groups.end * blocks * Rows8x32::<L>::GROUP_BLOCK_BYTES <= m.filled);
        assert!(acts.scales.len() >= acts.n * blocks);
        // Σ (q + offset) · a = Σ q · a + offset · Σ a: each block's sum starts
        // from −offset · Σ a, the same for every row group, so worked out once.
        let starts: Vec<i32> = (0..acts.n * blocks)
            .map(|i| {
                let (t, b) = (i / blocks, i % blocks);
                -L::OFFSET * (acts.sum16(t, 2 * b) + acts.sum16(t, 2 * b + 1))
            })
            .collect();
        // With several activation rows, the broadcasts of four of their bytes
        // are what the loads wait on: two row groups share each of them.
        let paired = if acts.n > 1 { groups.len() / 2 * 2 } else { 0 };
        let o = out.as_mut_ptr();
        for i in (0..paired).step_by(2) {
            let mut t0 = 0;
            while t0 < acts.n {
                let tn = T_PAIR.min(acts.n - t0);
                // SAFETY (all arms): the features are enabled here; groups
                // `g, g + 1` lie inside the filled blocks, rows `t0..t0 + tn`
                // inside the activations, their scales, `starts` and `out`
                // (whose columns `8i..8i + 16` they write), as asserted above.
                unsafe {
                    let at = (
                        m,
                        groups.start + i,
                        acts,
                        &starts[..],
                        t0,
                        o.add(i * ROWS),
                        len,
                    );
                    match tn {
                        1 => pair_t::<L, 1>(at),
                        2 => pair_t::<L, 2>(at),
                        3 => pair_t::<L, 3>(at),
                        _ => pair_t::<L, 4>(at),
                    }
                }
                t0 += tn;
            }
        }
        for (i, g) in groups.enumerate().skip(paired) {
            let mut t0 = 0;
            while t0 < acts.n {
                let tn = T_MAX.min(acts.n - t0);
                // SAFETY (all arms): the features are enabled here; group `g`
                // lies inside the filled blocks, and rows `t0..t0 + tn` inside
                // the activations, their scales, `starts` and `out`, as
                // asserted above.
                let y: [[f32; ROWS]; T_MAX] = unsafe {
                    match tn {
                        1 => group_t::<L, 1>(m, g, acts, &starts, t0),
                        2 => group_t::<L, 2>(m, g, acts, &starts, t0),
                        3 => group_t::<L, 3>(m, g, acts, &starts, t0),
                        4 => group_t::<L, 4>(m, g, acts, &starts, t0),
                        5 => group_t::<L, 5>(m, g, acts, &starts, t0),
                        6 => group_t::<L, 6>(m, g, acts, &starts, t0),
                        7 => group_t::<L, 7>(m, g, acts, &starts, t0),
                        _ => group_t::<L, 8>(m, g, acts, &starts, t0),
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

    /// Units `j` and `j + 4` (values `4j..` and `16 + 4j..` of the eight
    /// rows) of the block at `blk`, as unsigned levels.
    #[inline(always)]
    unsafe fn units<L: Layout32>(blk: *const u8, j: usize) -> [__m256i; 2] {
        let load = |at: usize| _mm256_loadu_si256(blk.add(at).cast());
        if L::KIND == Kind32::Q8_0 {
            return [load(LEVELS + 32 * j), load(LEVELS + 32 * (j + 4))];
        }
        let q = load(LEVELS + 32 * j);
        let low = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(q, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if L::KIND == Kind32::Q4_0 {
            return [lo, hi];
        }
        // Q5_0: 16 added in the lanes whose fifth bit is set.
        let mask = |u: usize| blk.add(MASKS + 4 * u).cast::<u32>().read_unaligned();
        let sixteen = _mm256_set1_epi8(16);
        [
            _mm256_mask_add_epi8(lo, mask(j), lo, sixteen),
            _mm256_mask_add_epi8(hi, mask(j + 4), hi, sixteen),
        ]
    }

    /// Row group `g` against the `T` activation rows from `t0`; `starts`
    /// holds each activation block's starting sum (`[n, blocks]`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn group_t<L: Layout32, const T: usize>(
        m: &Rows8x32<L>,
        g: usize,
        acts: &QuantizedActs,
        starts: &[i32],
        t0: usize,
    ) -> [[f32; ROWS]; T_MAX] {
        let blocks = m.blocks_per_row();
        let block_bytes = Rows8x32::<L>::GROUP_BLOCK_BYTES;
        let base = m.blocks().as_ptr().add(g * blocks * block_bytes);
        let qs: [*const u8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr().cast());
        let first: [*const i32; T] =
            std::array::from_fn(|k| starts.as_ptr().add((t0 + k) * blocks));
        let scales: [*const f32; T] =
            std::array::from_fn(|k| acts.scales.as_ptr().add((t0 + k) * blocks));
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            let blk = base.add(b * block_bytes);
            crate::prefetch_ahead(blk, block_bytes);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            let mut isum: [__m256i; T] =
                std::array::from_fn(|k| _mm256_set1_epi32(*first[k].add(b)));
            // With one activation row, the high units add into a sum of
            // their own: two chains of four `vpdpbusd` instead of one of eight.
            let mut isum2 = [_mm256_setzero_si256(); T];
            for j in 0..4 {
                let [wa, wb] = units::<L>(blk, j);
                for k in 0..T {
                    let four = |at: usize| {
                        _mm256_set1_epi32(qs[k].add(BLOCK * b + at).cast::<i32>().read_unaligned())
                    };
                    isum[k] = _mm256_dpbusd_epi32(isum[k], wa, four(4 * j));
                    if T == 1 {
                        isum2[k] = _mm256_dpbusd_epi32(isum2[k], wb, four(16 + 4 * j));
                    } else {
                        isum[k] = _mm256_dpbusd_epi32(isum[k], wb, four(16 + 4 * j));
                    }
                }
            }
            let isum: [__m256i; T] = std::array::from_fn(|k| _mm256_add_epi32(isum[k], isum2[k]));
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

    /// Where [`pair_t`] works: the matrix, its first row group `g`, the
    /// activations, their blocks' starting sums (`[n, blocks]`), the first
    /// activation row `t0`, and the output at group `g`'s first column with
    /// the output's row length.
    type At<'a, L> = (
        &'a Rows8x32<L>,
        usize,
        &'a QuantizedActs,
        &'a [i32],
        usize,
        *mut f32,
        usize,
    );

    /// [`group_t`] for row groups `g` and `g + 1` at once, each broadcast
    /// of activation bytes feeding both: row `t0 + k`'s sums for group
    /// `g + h` go to `out + (t0 + k) · len + 8h`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn pair_t<L: Layout32, const T: usize>(at: At<L>) {
        let (m, g, acts, starts, t0, out, len) = at;
        let blocks = m.blocks_per_row();
        let block_bytes = Rows8x32::<L>::GROUP_BLOCK_BYTES;
        let base: [*const u8; 2] =
            std::array::from_fn(|h| m.blocks().as_ptr().add((g + h) * blocks * block_bytes));
        let qs: [*const u8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr().cast());
        let first: [*const i32; T] =
            std::array::from_fn(|k| starts.as_ptr().add((t0 + k) * blocks));
        let scales: [*const f32; T] =
            std::array::from_fn(|k| acts.scales.as_ptr().add((t0 + k) * blocks));
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        for b in 0..blocks {
            let blk: [*const u8; 2] = std::array::from_fn(|h| base[h].add(b * block_bytes));
            blk.iter()
                .for_each(|&blk| crate::prefetch_ahead(blk, block_bytes));
            let dw: [__m256; 2] =
                std::array::from_fn(|h| _mm256_cvtph_ps(_mm_loadu_si128(blk[h].cast())));
            let mut isum: [[__m256i; T]; 2] = std::array::from_fn(|_| {
                std::array::from_fn(|k| _mm256_set1_epi32(*first[k].add(b)))
            });
            for j in 0..4 {
                let units: [[__m256i; 2]; 2] = std::array::from_fn(|h| units::<L>(blk[h], j));
                for k in 0..T {
                    let four = |at: usize| {
                        _mm256_set1_epi32(qs[k].add(BLOCK * b + at).cast::<i32>().read_unaligned())
                    };
                    let (lo, hi) = (four(4 * j), four(16 + 4 * j));
                    for h in 0..2 {
                        let [wa, wb] = units[h];
                        isum[h][k] = _mm256_dpbusd_epi32(isum[h][k], wa, lo);
                        isum[h][k] = _mm256_dpbusd_epi32(isum[h][k], wb, hi);
                    }
                }
            }
            for h in 0..2 {
                for k in 0..T {
                    let d = _mm256_mul_ps(dw[h], _mm256_set1_ps(*scales[k].add(b)));
                    acc[h][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][k]), d, acc[h][k]);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add((t0 + k) * len + ROWS * h), *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_0;
    use crate::testing::{random_blocks, values};

    /// GGUF bytes of a `[rows, cols]` matrix in layout `L`'s format.
    fn gguf<L: Layout32>(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        match L::KIND {
            Kind32::Q8_0 => q8_0::quantize(&values(rows * cols, seed, 1.0), cols),
            _ => random_blocks(rows * cols / BLOCK, L::GGUF_BYTES, &[0], seed),
        }
    }

    fn restores_every_byte<L: Layout32>() {
        let (rows, cols) = (24, 96);
        let gguf = gguf::<L>(rows, cols, 5);
        let m = Rows8x32::<L>::from_gguf(&gguf, rows, cols).expect("whole groups");
        assert_eq!(m.stored_bytes(), gguf.len());
        let mut blk = vec![0u8; L::GGUF_BYTES];
        for r in 0..rows {
            for b in 0..cols / BLOCK {
                m.restore(r, b, &mut blk);
                let at = (r * cols / BLOCK + b) * L::GGUF_BYTES;
                assert_eq!(
                    blk,
                    &gguf[at..at + L::GGUF_BYTES],
                    "{} row {r} block {b}",
                    L::NAME
                );
            }
        }
        // Not whole groups of eight rows, or the wrong length: refused.
        assert!(Rows8x32::<L>::from_gguf(&gguf[..gguf.len() / 24 * 4], 4, cols).is_none());
        assert!(Rows8x32::<L>::from_gguf(&gguf[1..], rows, cols).is_none());
    }

    #[test]
    fn interleaving_restores_every_byte() {
        restores_every_byte::<Q8_0x8>();
        restores_every_byte::<Q4_0x8>();
        restores_every_byte::<Q5_0x8>();
    }

    /// Every product of the interleaved matrix equals the exact integer
    /// sums of the GGUF blocks' levels with the rounded activations (within
    /// f32 rounding), for ranges that cut groups and activation row counts
    /// on both sides of the kernel's eight-row step; the exact path agrees
    /// with the GGUF-layout matrix to the bit.
    fn products_match<L: Layout32>() {
        let (rows, cols) = (40, 160);
        let gguf = gguf::<L>(rows, cols, 9);
        let plain = L::gguf_matrix(Bytes::from_vec(gguf.clone()), rows, cols).expect("sizes");
        let x8 = Rows8x32::<L>::from_gguf(&gguf, rows, cols).expect("whole groups");
        let mut widened = vec![0f32; rows * cols];
        plain.dequantize_rows(0..rows, &mut widened);
        for n in [1, 3, 4, 8, 9, 17] {
            let x = values(n * cols, 30 + n as u64, 2.0);
            let acts = QuantizedActs::quantize(&x, n, cols, ActBlock::B32);
            for range in [0..rows, 8..24, 3..29, 33..40] {
                let len = range.len();
                let mut want = vec![0f32; n * len];
                let mut got = vec![0f32; n * len];
                // The reference: each block's widened values (level · d,
                // exact in f32) against the activations' integer levels,
                // summed in f64 and scaled block by block.
                for t in 0..n {
                    for (i, r) in range.clone().enumerate() {
                        let row = &widened[r * cols..(r + 1) * cols];
                        let mut sum = 0f64;
                        for b in 0..cols / BLOCK {
                            let dot: f64 = (b * BLOCK..(b + 1) * BLOCK)
                                .map(|c| f64::from(row[c]) * f64::from(acts.row(t)[c]))
                                .sum();
                            sum += f64::from(acts.scale(t, b)) * dot;
                        }
                        want[t * len + i] = sum as f32;
                    }
                }
                x8.int_dots(range.clone(), &acts, &mut got);
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{} n={n} {range:?} [{i}]: {g} vs {w}",
                        L::NAME
                    );
                }
                let mut exact_plain = vec![0f32; n * len];
                let mut exact_x8 = vec![0f32; n * len];
                plain.dots(range.clone(), &x, n, &mut exact_plain);
                x8.dots(range.clone(), &x, n, &mut exact_x8);
                assert_eq!(exact_plain, exact_x8, "{} exact n={n} {range:?}", L::NAME);
            }
        }
        let mut a = vec![0f32; 2 * cols];
        let mut b = vec![0f32; 2 * cols];
        plain.dequantize_rows(5..7, &mut a);
        x8.dequantize_rows(5..7, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn interleaved_products_match_the_gguf_layout() {
        products_match::<Q8_0x8>();
        products_match::<Q4_0x8>();
        products_match::<Q5_0x8>();
    }
}
