//! Q4_K and Q6_K matrices rearranged at load, eight rows interleaved, for
//! the AVX-512 VNNI kernels of the fast (8-bit activation) mode.
//!
//! In GGUF's layout a k-quant row reads as super-blocks of 256 values, and
//! a kernel spends most of its time per super-block unpacking one row's
//! scales and summing one row's lanes: on a decode step it ran below the
//! memory's rate. Here each super-block column of eight rows is one block:
//! the eight rows' float scales side by side, their integer scales (and
//! Q4_K's mins) as plain bytes ordered by sub-block then row, and the level
//! bits in 32-byte units that hold four consecutive values of each of the
//! eight rows. One `vpdpbusd` multiplies such a unit with four activation
//! bytes broadcast to every lane, so the eight rows' sums build up side by
//! side in one register, and the scales are applied once per sub-block to
//! all eight. The rearrangement is lossless: [`Rows8::restore`] gives a
//! row's super-block back in GGUF's bytes, which the exact and fallback
//! paths use.

use std::marker::PhantomData;
use std::ops::Range;

use crate::intdot;
use crate::kquant::{self, SuperBlock, SUPER};
use crate::{ActBlock, IntegerDots, QuantizedActs, Rearranged, WeightMatrix};

/// Rows interleaved in one block.
pub const ROWS: usize = 8;

/// A k-quant format's eight-row block.
pub trait Layout8: Send + Sync + std::fmt::Debug + 'static {
    /// The format in GGUF's layout.
    type Gguf: SuperBlock;
    /// Storage name in reports.
    const NAME: &'static str;
    /// Bytes of one eight-row block.
    const BLOCK_BYTES: usize;
    /// Calls `copy(at, to, len)` for each run of bytes that moves unchanged
    /// between a GGUF super-block (from `at`) and row `r` of the block
    /// (from `to`).
    fn runs(r: usize, copy: impl FnMut(usize, usize, usize));
    /// Writes what does not move as bytes (Q4_K's packed 6-bit scales) of
    /// GGUF super-block `src` into row `r` of the block `dst`.
    fn pack_rest(_src: &[u8], _r: usize, _dst: &mut [u8]) {}
    /// The inverse of [`Layout8::pack_rest`].
    fn unpack_rest(_src: &[u8], _r: usize, _dst: &mut [u8]) {}
    /// Writes GGUF super-block `src` as row `r` of the block `dst`.
    fn pack(src: &[u8], r: usize, dst: &mut [u8]) {
        Self::runs(r, |at, to, len| {
            dst[to..to + len].copy_from_slice(&src[at..at + len]);
        });
        Self::pack_rest(src, r, dst);
    }
    /// The inverse of [`Layout8::pack`]: row `r` of block `src` in GGUF's bytes.
    fn unpack(src: &[u8], r: usize, dst: &mut [u8]) {
        Self::runs(r, |at, from, len| {
            dst[at..at + len].copy_from_slice(&src[from..from + len]);
        });
        Self::unpack_rest(src, r, dst);
    }
    /// `Σ x · w` over one row in GGUF's bytes, f32 activations.
    fn dot_exact(x: &[f32], row: &[u8]) -> f32;
}

/// Q4_K's block: eight f16 `d`, eight f16 `dmin`, scales `[j][row]` and
/// mins `[j / 2][row][j % 2]` of the eight 32-value sub-blocks `j`, then 32
/// units of nibbles: unit `8m + t` holds, for each row, bytes `4t..4t + 4`
/// of the row's sub-block pair `m` (values `64m + 4t..` in the low nibbles,
/// `64m + 32 + 4t..` in the high ones). 1184 bytes for 8 · 144.
#[derive(Debug)]
pub struct Q4K8;

mod q4k {
    pub const D: usize = 0;
    pub const DMIN: usize = 16;
    pub const SCALES: usize = 32;
    pub const MINS: usize = 96;
    pub const QS: usize = 160;
    pub const BYTES: usize = QS + 8 * 128;
}

impl Layout8 for Q4K8 {
    type Gguf = kquant::Q4K;
    const NAME: &'static str = "Q4_Kx8";
    const BLOCK_BYTES: usize = q4k::BYTES;

    fn runs(r: usize, mut copy: impl FnMut(usize, usize, usize)) {
        use q4k::*;
        copy(0, D + 2 * r, 2);
        copy(2, DMIN + 2 * r, 2);
        for m in 0..4 {
            for t in 0..8 {
                copy(16 + 32 * m + 4 * t, QS + 32 * (8 * m + t) + 4 * r, 4);
            }
        }
    }

    fn pack_rest(src: &[u8], r: usize, dst: &mut [u8]) {
        use q4k::*;
        for j in 0..8 {
            let (sc, mn) = intdot::scale_min(j, &src[4..16]);
            dst[SCALES + ROWS * j + r] = sc as u8;
            dst[MINS + 2 * ROWS * (j / 2) + 2 * r + j % 2] = mn as u8;
        }
    }

    fn unpack_rest(src: &[u8], r: usize, dst: &mut [u8]) {
        use q4k::*;
        let sc = |j: usize| src[SCALES + ROWS * j + r];
        let mn = |j: usize| src[MINS + 2 * ROWS * (j / 2) + 2 * r + j % 2];
        // GGUF's twelve bytes: scales and mins 0–3 in the low six bits of
        // bytes 0–7, 4–7 as nibbles of bytes 8–11 with their top two bits
        // in the top bits of bytes 0–7 (see `intdot::scale_min`).
        for j in 0..4 {
            dst[4 + j] = sc(j) | ((sc(j + 4) >> 4) << 6);
            dst[8 + j] = mn(j) | ((mn(j + 4) >> 4) << 6);
            dst[12 + j] = (sc(j + 4) & 0xF) | ((mn(j + 4) & 0xF) << 4);
        }
    }

    fn dot_exact(x: &[f32], row: &[u8]) -> f32 {
        kquant::dot_q4k(x, row)
    }
}

/// Q6_K's block: eight f16 `d`, the signed scales of the sixteen 16-value
/// sub-blocks `j` as `[j / 2][row][j % 2]`, then sixteen steps of three
/// units in the order the kernel reads them: step `8n + t` holds, for each
/// row, bytes `64n + 4t..` and `64n + 32 + 4t..` of `ql` and `32n + 4t..`
/// of `qh`. 1680 bytes, the same as 8 · 210.
#[derive(Debug)]
pub struct Q6K8;

mod q6k {
    pub const D: usize = 0;
    pub const SCALES: usize = 16;
    /// Sixteen steps of 96 bytes: `ql` low half, `ql` high half, `qh`.
    pub const STEPS: usize = 144;
    pub const BYTES: usize = STEPS + 16 * 96;

    /// The GGUF offsets of step `st`'s three units (one row's four bytes each).
    pub const fn sources(st: usize) -> [usize; 3] {
        let (n, t) = (st / 8, st % 8);
        [64 * n + 4 * t, 64 * n + 32 + 4 * t, 128 + 32 * n + 4 * t]
    }
}

impl Layout8 for Q6K8 {
    type Gguf = kquant::Q6K;
    const NAME: &'static str = "Q6_Kx8";
    const BLOCK_BYTES: usize = q6k::BYTES;

    fn runs(r: usize, mut copy: impl FnMut(usize, usize, usize)) {
        use q6k::*;
        copy(208, D + 2 * r, 2);
        for j in 0..16 {
            copy(192 + j, SCALES + 2 * ROWS * (j / 2) + 2 * r + j % 2, 1);
        }
        for st in 0..16 {
            for (k, at) in sources(st).into_iter().enumerate() {
                copy(at, STEPS + 96 * st + 32 * k + 4 * r, 4);
            }
        }
    }

    fn dot_exact(x: &[f32], row: &[u8]) -> f32 {
        kquant::dot_q6k(x, row)
    }
}

/// A `[rows, cols]` k-quant matrix (`rows` a multiple of [`ROWS`]) held as
/// eight-row blocks of layout `L`: row group after row group, each group's
/// super-blocks in column order.
/// The blocks live in [`arena`](crate::arena) memory (huge pages where the
/// system grants them), filled as rows are appended.
#[derive(Debug)]
pub struct Rows8<L> {
    store: crate::arena::Piece,
    /// Bytes of `store` the appended rows fill.
    filled: usize,
    rows: usize,
    cols: usize,
    layout: PhantomData<L>,
}

/// Q4_K with eight rows interleaved.
pub type Q4KRows8 = Rows8<Q4K8>;
/// Q6_K with eight rows interleaved.
pub type Q6KRows8 = Rows8<Q6K8>;

impl<L: Layout8> Rearranged for Rows8<L> {
    const NAME: &'static str = L::NAME;
    const GROUP_ROWS: usize = ROWS;

    fn with_capacity(rows: usize, cols: usize) -> Option<Self> {
        (cols.is_multiple_of(SUPER) && rows.is_multiple_of(ROWS)).then(|| Self {
            store: crate::arena::alloc_zeroed(Self::bytes_for(rows, cols)),
            filled: 0,
            rows: 0,
            cols,
            layout: PhantomData,
        })
    }

    fn bytes_for(rows: usize, cols: usize) -> usize {
        rows / ROWS * (cols / SUPER) * L::BLOCK_BYTES
    }

    /// Row groups are spread over the thread pool.
    fn append_gguf(&mut self, data: &[u8]) -> bool {
        let (supers, gguf) = (self.supers(), L::Gguf::BYTES);
        let group_in = ROWS * supers * gguf;
        if supers == 0 || !data.len().is_multiple_of(group_in) {
            return false;
        }
        let groups = data.len() / group_in;
        let group_out = supers * L::BLOCK_BYTES;
        let (start, end) = (self.filled, self.filled + groups * group_out);
        if end > self.store.len() {
            return false;
        }
        let fresh = &mut self.store.as_mut_slice()[start..end];
        crate::pool::global().for_each_chunk(fresh, group_out, &|g, out| {
            let src = &data[g * group_in..(g + 1) * group_in];
            for (s, dst) in out.chunks_exact_mut(L::BLOCK_BYTES).enumerate() {
                for r in 0..ROWS {
                    let at = (r * supers + s) * gguf;
                    L::pack(&src[at..at + gguf], r, dst);
                }
            }
        });
        self.filled = end;
        self.rows += groups * ROWS;
        true
    }
}

impl<L: Layout8> Rows8<L> {
    fn supers(&self) -> usize {
        self.cols / SUPER
    }

    /// The appended rows' blocks.
    fn blocks(&self) -> &[u8] {
        &self.store.as_slice()[..self.filled]
    }

    /// Super-block `s` of row `r` in GGUF's bytes (`out`: one super-block).
    pub fn restore(&self, r: usize, s: usize, out: &mut [u8]) {
        let at = ((r / ROWS) * self.supers() + s) * L::BLOCK_BYTES;
        L::unpack(&self.blocks()[at..at + L::BLOCK_BYTES], r % ROWS, out);
    }

    /// Rows `rows` in GGUF's bytes, row after row.
    fn restore_rows(&self, rows: Range<usize>) -> Vec<u8> {
        let (supers, gguf) = (self.supers(), L::Gguf::BYTES);
        let mut out = vec![0u8; rows.len() * supers * gguf];
        for (blk, (r, s)) in out
            .chunks_exact_mut(gguf)
            .zip(rows.flat_map(|r| (0..supers).map(move |s| (r, s))))
        {
            self.restore(r, s, blk);
        }
        out
    }
}

impl<L: Layout8> WeightMatrix for Rows8<L> {
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
        let mut blk = vec![0u8; L::Gguf::BYTES];
        let mut values = [0f32; SUPER];
        for (i, r) in rows.enumerate() {
            let o = &mut out[i * self.cols..(i + 1) * self.cols];
            for (s, ob) in o.chunks_exact_mut(SUPER).enumerate() {
                self.restore(r, s, &mut blk);
                L::Gguf::decode(&blk, &mut values);
                ob.copy_from_slice(&values);
            }
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        for (i, r) in rows.enumerate() {
            let row = self.restore_rows(r..r + 1);
            for t in 0..n {
                out[t * len + i] = L::dot_exact(&x[t * cols..(t + 1) * cols], &row);
            }
        }
    }
    fn integer(&self) -> Option<&dyn IntegerDots> {
        Some(self)
    }
}

impl<L: Layout8> IntegerDots for Rows8<L> {
    fn act_block(&self) -> ActBlock {
        ActBlock::B256
    }
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]) {
        assert_eq!(acts.block, ActBlock::B256);
        #[cfg(target_arch = "x86_64")]
        if intdot::has_vnni() {
            crate::in_whole_groups(rows, ROWS, acts.n, out, |groups, out| {
                // SAFETY: `has_vnni` detected the features the kernel needs.
                unsafe { avx512::dots(self, groups, acts, out) }
            });
            return;
        }
        // Elsewhere (the loader interleaves only where VNNI is present; tests
        // force this path): GGUF's bytes through the k-quant kernels.
        let data = self.restore_rows(rows.clone());
        intdot::matrix_k(L::Gguf::KIND, 0..rows.len(), &data, acts, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{q4k, q6k, Layout8, Rows8, ROWS};
    use crate::intdot::{KindK, GROUP};
    use crate::kquant::SuperBlock;
    use crate::QuantizedActs;

    /// `out[t · len + 8 · (g − groups.start) + r] = Σ_c acts[t, c] ·
    /// W[8g + r, c]` for the row groups `groups` (`len` = 8 · their count),
    /// [`GROUP`] activation rows at a time, each weight block unpacked once
    /// for all of them.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots<L: Layout8>(
        m: &Rows8<L>,
        groups: Range<usize>,
        acts: &QuantizedActs,
        out: &mut [f32],
    ) {
        // The kernels below read and write through raw pointers within these bounds.
        assert!(acts.cols == m.cols && groups.end * ROWS <= m.rows);
        assert!(out.len() >= acts.n * groups.len() * ROWS);
        let supers = m.supers();
        let kind = L::Gguf::KIND;
        // The activations' sums over pairs of sub-blocks (Q4_K's 32 values,
        // against its mins; Q6_K's 16, against its scales for the offset
        // of 32), as the i16 halves of one word that `vpmaddwd` multiplies
        // with a row's two factors: [n, supers, pairs].
        let (per, span) = if kind == KindK::Q6K { (8, 1) } else { (4, 2) };
        let mut pairs = vec![0i32; acts.n * supers * per];
        for (t, row) in pairs.chunks_exact_mut(supers * per).enumerate() {
            for (p, w) in row.iter_mut().enumerate() {
                let sum = |j: usize| {
                    let mut s = 0;
                    for k in 0..span {
                        s += acts.sum16(t, span * j + k);
                    }
                    s
                };
                *w = (sum(2 * p) & 0xFFFF) | (sum(2 * p + 1) << 16);
            }
        }
        let len = groups.len() * ROWS;
        let bytes = supers * L::BLOCK_BYTES;
        let blocks = m.blocks();
        for t0 in (0..acts.n).step_by(GROUP) {
            for (i, g) in groups.clone().enumerate() {
                let w = blocks[g * bytes..(g + 1) * bytes].as_ptr();
                let o = out[t0 * len + i * ROWS..].as_mut_ptr();
                let a = Acts {
                    acts,
                    pairs: &pairs,
                    per,
                    t0,
                };
                macro_rules! by_rows {
                    ($f:ident) => {
                        match (acts.n - t0).min(GROUP) {
                            1 => $f::<1>(w, supers, &a, o, len),
                            2 => $f::<2>(w, supers, &a, o, len),
                            3 => $f::<3>(w, supers, &a, o, len),
                            _ => $f::<4>(w, supers, &a, o, len),
                        }
                    };
                }
                match kind {
                    KindK::Q4K => by_rows!(q4k_t),
                    KindK::Q6K => by_rows!(q6k_t),
                    KindK::Q5K => unreachable!("no eight-row layout for Q5_K"),
                }
            }
        }
    }

    /// The activation rows from `t0` as a group kernel reads them.
    struct Acts<'a> {
        acts: &'a QuantizedActs,
        pairs: &'a [i32],
        per: usize,
        t0: usize,
    }

    impl Acts<'_> {
        /// Four activation bytes of row `t0 + k` (values `at..at + 4`) in every lane.
        #[inline(always)]
        unsafe fn bcast(&self, k: usize, at: usize) -> __m256i {
            let p = self.acts.row(self.t0 + k).as_ptr().add(at);
            _mm256_set1_epi32((p as *const i32).read_unaligned())
        }
        /// Pair `p` of super-block `s`'s sums for row `t0 + k`, in every lane.
        #[inline(always)]
        unsafe fn pair(&self, k: usize, s: usize, p: usize, supers: usize) -> __m256i {
            let at = ((self.t0 + k) * supers + s) * self.per + p;
            _mm256_set1_epi32(*self.pairs.get_unchecked(at))
        }
        /// Scale of row `t0 + k`'s super-block `s`, in every lane.
        #[inline(always)]
        unsafe fn scale(&self, k: usize, s: usize) -> __m256 {
            _mm256_set1_ps(self.acts.scale(self.t0 + k, s))
        }
    }

    /// Eight Q4_K rows (blocks from `w`) against the `T` activation rows;
    /// row `t0 + k`'s eight sums go to `out + k · len`.
    #[inline(always)]
    unsafe fn q4k_t<const T: usize>(
        w: *const u8,
        supers: usize,
        a: &Acts,
        out: *mut f32,
        len: usize,
    ) {
        use q4k::*;
        let low = _mm256_set1_epi8(0x0F);
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        let mut acc = [_mm256_setzero_ps(); T];
        for s in 0..supers {
            let blk = w.add(s * BYTES);
            crate::prefetch_ahead(blk, BYTES);
            let mut sum = [_mm256_setzero_si256(); T];
            for p in 0..4 {
                // Sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles, kept
                // at 16× their level: no shift per unit, one per sum).
                // With one activation row, even and odd units add into
                // separate sums: two chains of four `vpdpbusd` per half
                // instead of one of eight, whose latency set the pace.
                let mut lo = [[_mm256_setzero_si256(); T]; 2];
                let mut hi = [[_mm256_setzero_si256(); T]; 2];
                for u in 0..8 {
                    let e = if T == 1 { u % 2 } else { 0 };
                    let q = _mm256_loadu_si256(blk.add(QS + 32 * (8 * p + u)) as *const __m256i);
                    let (ql, qh) = (_mm256_and_si256(q, low), _mm256_and_si256(q, high));
                    for k in 0..T {
                        let at = 256 * s + 64 * p + 4 * u;
                        lo[e][k] = _mm256_dpbusd_epi32(lo[e][k], ql, a.bcast(k, at));
                        hi[e][k] = _mm256_dpbusd_epi32(hi[e][k], qh, a.bcast(k, at + 32));
                    }
                }
                let lo: [__m256i; T] =
                    std::array::from_fn(|k| _mm256_add_epi32(lo[0][k], lo[1][k]));
                let hi: [__m256i; T] =
                    std::array::from_fn(|k| _mm256_add_epi32(hi[0][k], hi[1][k]));
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
                let mut by_min = _mm256_madd_epi16(mins[0], a.pair(k, s, 0, supers));
                for (p, &mn) in mins.iter().enumerate().skip(1) {
                    by_min =
                        _mm256_add_epi32(by_min, _mm256_madd_epi16(mn, a.pair(k, s, p, supers)));
                }
                let da = a.scale(k, s);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k]), _mm256_mul_ps(d, da), acc[k]);
                acc[k] =
                    _mm256_fnmadd_ps(_mm256_cvtepi32_ps(by_min), _mm256_mul_ps(dmin, da), acc[k]);
            }
        }
        for (k, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(k * len), *v);
        }
    }

    /// [`q4k_t`] for Q6_K: levels `ql | qh << 4` (0–63) by `vpdpbusd`, the
    /// offset of 32 taken off once per super-block through the activation
    /// sums.
    #[inline(always)]
    unsafe fn q6k_t<const T: usize>(
        w: *const u8,
        supers: usize,
        a: &Acts,
        out: *mut f32,
        len: usize,
    ) {
        use q6k::*;
        let low = _mm256_set1_epi8(0x0F);
        let top = _mm256_set1_epi8(0x30);
        let load = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
        // Lane r: row r's scales of sub-blocks 2jp and 2jp + 1, as i16 halves.
        let scale_pair = |blk: *const u8, jp: usize| {
            _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(SCALES + 16 * jp) as *const __m128i))
        };
        let mut acc = [_mm256_setzero_ps(); T];
        for s in 0..supers {
            let blk = w.add(s * BYTES);
            crate::prefetch_ahead(blk, BYTES);
            let mut sum = [_mm256_setzero_si256(); T];
            for n in 0..2 {
                for half in 0..2 {
                    // Register c holds values 128n + 32c + 4t.. of sub-block
                    // 8n + 2c + half (t in this half's four units).
                    let mut dot = [[_mm256_setzero_si256(); T]; 4];
                    for t in 4 * half..4 * half + 4 {
                        let step = blk.add(STEPS + 96 * (8 * n + t));
                        let (l0, l1, qh) = (load(step), load(step.add(32)), load(step.add(64)));
                        let lo4 = |q: __m256i| _mm256_and_si256(q, low);
                        let hi4 = |q: __m256i| _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                        let bits = |q: __m256i| _mm256_and_si256(q, top);
                        let u = [
                            _mm256_or_si256(lo4(l0), bits(_mm256_slli_epi16(qh, 4))),
                            _mm256_or_si256(lo4(l1), bits(_mm256_slli_epi16(qh, 2))),
                            _mm256_or_si256(hi4(l0), bits(qh)),
                            _mm256_or_si256(hi4(l1), bits(_mm256_srli_epi16(qh, 2))),
                        ];
                        for (c, (&uc, dc)) in u.iter().zip(dot.iter_mut()).enumerate() {
                            for (k, d) in dc.iter_mut().enumerate() {
                                let v = a.bcast(k, 256 * s + 128 * n + 32 * c + 4 * t);
                                *d = _mm256_dpbusd_epi32(*d, uc, v);
                            }
                        }
                    }
                    for (c, d) in dot.iter().enumerate() {
                        let p = scale_pair(blk, 4 * n + c);
                        let sc = if half == 0 {
                            _mm256_srai_epi32(_mm256_slli_epi32(p, 16), 16)
                        } else {
                            _mm256_srai_epi32(p, 16)
                        };
                        for k in 0..T {
                            sum[k] = _mm256_add_epi32(sum[k], _mm256_mullo_epi32(d[k], sc));
                        }
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(D) as *const __m128i));
            for k in 0..T {
                let mut offset = _mm256_setzero_si256();
                for jp in 0..8 {
                    let by = _mm256_madd_epi16(scale_pair(blk, jp), a.pair(k, s, jp, supers));
                    offset = _mm256_add_epi32(offset, by);
                }
                let total = _mm256_sub_epi32(sum[k], _mm256_slli_epi32(offset, 5));
                let scale = _mm256_mul_ps(d, a.scale(k, s));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[k]);
            }
        }
        for (k, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(k * len), *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kquant::SuperBlockMatrix;
    use crate::testing::values;

    /// Random super-blocks of `F` whose f16 fields (at `halves`) are sane scales.
    fn gguf_bytes<F: SuperBlock>(blocks: usize, halves: &[usize], seed: u64) -> Vec<u8> {
        crate::testing::random_blocks(blocks, F::BYTES, halves, seed)
    }

    #[test]
    fn interleaving_restores_every_byte() {
        let (rows, cols) = (16, 768);
        let q4 = gguf_bytes::<kquant::Q4K>(rows * cols / SUPER, &[0, 2], 5);
        let m = Q4KRows8::from_gguf(&q4, rows, cols).expect("sizes");
        assert_eq!(m.restore_rows(0..rows), q4);
        assert!(Q4KRows8::from_gguf(&q4[..q4.len() - 144], rows, cols).is_none());
        assert!(Q4KRows8::from_gguf(&q4, rows / 2 + 1, cols).is_none());
        let q6 = gguf_bytes::<kquant::Q6K>(rows * cols / SUPER, &[208], 6);
        let m = Q6KRows8::from_gguf(&q6, rows, cols).expect("sizes");
        assert_eq!(m.restore_rows(0..rows), q6);
        assert_eq!(m.stored_bytes(), q6.len());
    }

    #[test]
    fn interleaved_products_match_the_gguf_layout() {
        let (rows, cols) = (24, 512);
        let q4 = gguf_bytes::<kquant::Q4K>(rows * cols / SUPER, &[0, 2], 9);
        check_against_gguf::<Q4K8>(q4, rows, cols);
        let q6 = gguf_bytes::<kquant::Q6K>(rows * cols / SUPER, &[208], 10);
        check_against_gguf::<Q6K8>(q6, rows, cols);
    }

    fn check_against_gguf<L: Layout8>(data: Vec<u8>, rows: usize, cols: usize) {
        let m = Rows8::<L>::from_gguf(&data, rows, cols).expect("sizes");
        let gguf = SuperBlockMatrix::<L::Gguf>::new(crate::Bytes::from_vec(data), rows, cols)
            .expect("sizes");
        let (mut a, mut b) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
        m.dequantize_rows(0..rows, &mut a);
        gguf.dequantize_rows(0..rows, &mut b);
        assert_eq!(a, b, "{}", L::NAME);
        for n in [1, 2, 3, 4, 5, 9] {
            let x = values(n * cols, n as u64, 2.0);
            let acts = QuantizedActs::quantize(&x, n, cols, ActBlock::B256);
            // Whole groups, and ranges that cut them: the same integer sums
            // as GGUF's layout, added up in another order.
            for rows in [0..rows, 8..16, 3..21, 9..10] {
                let len = rows.len();
                let (mut got, mut want) = (vec![0f32; n * len], vec![0f32; n * len]);
                m.int_dots(rows.clone(), &acts, &mut got);
                gguf.int_dots(rows.clone(), &acts, &mut want);
                let scale = want.iter().fold(1f32, |a, w| a.max(w.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * scale,
                        "{} n={n} rows {rows:?} [{i}]: {g} vs {w}",
                        L::NAME
                    );
                }
            }
            let exact = crate::matmul(&m, &x, n);
            assert_eq!(
                exact,
                crate::matmul(&gguf, &x, n),
                "{} n={n} exact",
                L::NAME
            );
        }
    }
}
