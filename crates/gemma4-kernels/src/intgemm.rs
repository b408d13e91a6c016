//! Integer products for many activation rows (prefill, large batches), with
//! AVX-512 VNNI.
//!
//! The weight rows are decoded [`PANEL_ROWS`] at a time into a panel of
//! unsigned 8-bit levels laid out four values per row, so that one 512-bit
//! register holds four consecutive values of 16 rows. Each activation row's
//! four matching bytes are broadcast, and one `vpdpbusd` adds four products
//! to each of the 16 rows' sums. A panel is decoded once per product and
//! then read for every activation row, so decoding costs almost nothing per
//! token, and the inner loop is the multiply alone.
//!
//! Every format is written `w = scale · u − off` per sub-block, with `u`
//! unsigned: Q4_K and Q5_K per 32 values (`d·sc`, `dmin·m`), Q6_K per 16
//! (`d·sc`, `32·d·sc`), and the 32-value formats with `u = v + 128` (`d`,
//! `128·d − m`). So one kernel serves them all, and the activations'
//! group sums carry the offsets.

use std::ops::Range;

use crate::acts::QuantizedActs;
use crate::intdot::{k_bytes, scales_k, Kind32, KindK, Row};

/// Weight rows per panel: one 512-bit register of 32-bit sums.
pub const PANEL_ROWS: usize = 16;

/// Activation rows that share each load of the panel.
const T_MAX: usize = 8;

/// [`PANEL_ROWS`] weight rows as the kernel reads them.
struct Panel {
    cols: usize,
    /// Values per sub-block (16 or 32): the span of one scale and offset.
    sub: usize,
    /// `[cols / 4][16][4]` levels.
    levels: Vec<u8>,
    /// `[cols / sub][16]`.
    scale: Vec<f32>,
    /// `[cols / sub][16]`.
    off: Vec<f32>,
    /// The rows as decoded, `[16][cols]`, before interleaving (the 32-value
    /// formats only; the k-quants are gathered from their own bytes).
    staging: Vec<u8>,
    /// One staged row's `(d, m)` per 32-value block (the 32-value formats only).
    dm: Vec<(f32, f32)>,
}

impl Panel {
    fn new(cols: usize, sub: usize) -> Self {
        let groups = cols / sub * PANEL_ROWS;
        Self {
            cols,
            sub,
            levels: vec![0; cols * PANEL_ROWS],
            scale: vec![0.0; groups],
            off: vec![0.0; groups],
            staging: Vec::new(),
            dm: Vec::new(),
        }
    }

    /// Rows past `filled` contribute nothing (their scales and offsets are 0).
    fn clear_from(&mut self, filled: usize) {
        if filled == PANEL_ROWS {
            return;
        }
        for j in 0..self.cols / self.sub {
            self.scale[j * PANEL_ROWS + filled..(j + 1) * PANEL_ROWS].fill(0.0);
            self.off[j * PANEL_ROWS + filled..(j + 1) * PANEL_ROWS].fill(0.0);
        }
    }

    /// `staging` into `levels`: 4-byte runs of each row side by side.
    fn interleave(&mut self) {
        // SAFETY: callers of this module checked the features.
        unsafe { vnni::interleave(self) }
    }

    /// Rows `rows` of the super-block matrix stored row after row in `data`.
    fn fill_k(&mut self, kind: KindK, rows: Range<usize>, data: &[u8]) {
        let per = 256 / self.sub;
        let row_bytes = self.cols / 256 * k_bytes(kind);
        let filled = rows.len();
        let mut sc = [0i32; 16];
        let mut mn = [0i32; 16];
        for (r, row) in rows.clone().enumerate() {
            let row = &data[row * row_bytes..(row + 1) * row_bytes];
            for (s, blk) in row.chunks_exact(k_bytes(kind)).enumerate() {
                let (d, dmin) = scales_k(kind, blk, &mut sc, &mut mn);
                for i in 0..per {
                    let j = s * per + i;
                    // `sc` and `mn` are per 16 values.
                    let g = i * self.sub / 16;
                    let scale = d * sc[g] as f32;
                    self.scale[j * PANEL_ROWS + r] = scale;
                    self.off[j * PANEL_ROWS + r] = if kind == KindK::Q6K {
                        32.0 * scale
                    } else {
                        dmin * mn[g] as f32
                    };
                }
            }
        }
        self.clear_from(filled);
        // SAFETY: callers of this module checked the features.
        unsafe {
            vnni::levels_k(
                self,
                kind,
                &data[rows.start * row_bytes..rows.end * row_bytes],
                row_bytes,
            )
        };
    }

    fn fill_32<'a>(&mut self, kind: Kind32, rows: Range<usize>, row_of: &dyn Fn(usize) -> Row<'a>) {
        let (cols, filled) = (self.cols, rows.len());
        self.dm.resize(cols / 32, (0.0, 0.0));
        self.staging.resize(cols * PANEL_ROWS, 0);
        for (r, row) in rows.map(row_of).enumerate() {
            // SAFETY: callers of this module checked the features; the row
            // holds `cols / 32` blocks of `kind`.
            unsafe {
                crate::intdot_avx2::stage32_vnni(
                    kind,
                    &row,
                    &mut self.staging[r * cols..(r + 1) * cols],
                    &mut self.dm,
                )
            };
            // Staged as `v + 128`: `w = d·v + m = d·(v + 128) − (128·d − m)`.
            for (b, &(d, m)) in self.dm.iter().enumerate() {
                self.scale[b * PANEL_ROWS + r] = d;
                self.off[b * PANEL_ROWS + r] = 128.0 * d - m;
            }
        }
        self.clear_from(filled);
        self.interleave();
    }
}

/// Σ of each sub-block's activation quants as f32, `[n, cols / sub]`.
fn group_sums(acts: &QuantizedActs, sub: usize) -> Vec<f32> {
    let per = sub / 16;
    acts.sums
        .chunks_exact(per)
        .map(|g| g.iter().sum::<i32>() as f32)
        .collect()
}

/// [`crate::intdot::matrix_k`] for many activation rows. The caller has
/// checked [`crate::intdot::has_vnni`].
pub(crate) fn matrix_k(
    kind: KindK,
    rows: Range<usize>,
    data: &[u8],
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let sub = if kind == KindK::Q6K { 16 } else { 32 };
    let mut panel = Panel::new(acts.cols, sub);
    product(&mut panel, rows, acts, out, &mut |p, r| {
        p.fill_k(kind, r, data)
    });
}

/// [`crate::intdot::matrix32`] for many activation rows. The caller has
/// checked [`crate::intdot::has_vnni`].
pub(crate) fn matrix32<'a>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let mut panel = Panel::new(acts.cols, 32);
    product(&mut panel, rows, acts, out, &mut |p, r| {
        p.fill_32(kind, r, row_of)
    });
}

fn product(
    panel: &mut Panel,
    rows: Range<usize>,
    acts: &QuantizedActs,
    out: &mut [f32],
    fill: &mut dyn FnMut(&mut Panel, Range<usize>),
) {
    let len = rows.len();
    assert_eq!(out.len(), acts.n * len, "output does not match the product");
    let sums = group_sums(acts, panel.sub);
    for i0 in (0..len).step_by(PANEL_ROWS) {
        let take = PANEL_ROWS.min(len - i0);
        fill(panel, rows.start + i0..rows.start + i0 + take);
        let mut t0 = 0;
        while t0 < acts.n {
            let tn = T_MAX.min(acts.n - t0);
            let at = Block { t0, i0, take, len };
            // SAFETY: the callers checked the features; `Block` stays inside
            // `out` ([n, len]) and the panel's rows.
            unsafe { vnni::dispatch(panel, acts, &sums, at, tn, out) };
            t0 += tn;
        }
    }
}

/// Which activation rows (`t0..t0 + T`) meet which panel, written where.
#[derive(Clone, Copy)]
struct Block {
    t0: usize,
    /// The panel's first row within the product's rows.
    i0: usize,
    /// Valid rows in the panel.
    take: usize,
    /// Rows of the product (the output's row stride).
    len: usize,
}

mod vnni {
    use super::{Block, Panel, PANEL_ROWS};
    use crate::acts::QuantizedActs;
    use crate::intdot::{k_bytes, KindK};
    use std::arch::x86_64::*;

    /// Byte offsets of the panel's rows from its first, for the gathers;
    /// the lanes past `take` are masked off.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_offsets(stride: usize, take: usize) -> (__m512i, __mmask16) {
        assert!(
            PANEL_ROWS * stride <= i32::MAX as usize,
            "rows too long to gather"
        );
        let idx: [i32; PANEL_ROWS] = std::array::from_fn(|r| (r * stride) as i32);
        // SAFETY: 16 i32s.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
        (idx, lanes(take))
    }

    /// The mask of the first `take` of 16 lanes.
    #[inline]
    fn lanes(take: usize) -> __mmask16 {
        if take >= PANEL_ROWS {
            !0
        } else {
            (1u16 << take) - 1
        }
    }

    /// The 4 bytes at `at` of each of the panel's rows (`take` rows of
    /// `stride` bytes from the start of `data`); 0 in the lanes past them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn gather(data: &[u8], idx: __m512i, mask: __mmask16, at: usize) -> __m512i {
        // SAFETY: the caller keeps `at + 4` inside each valid row of `data`.
        unsafe {
            _mm512_mask_i32gather_epi32::<1>(
                _mm512_setzero_si512(),
                mask,
                idx,
                data.as_ptr().add(at).cast(),
            )
        }
    }

    /// See [`Panel::interleave`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn interleave(p: &mut Panel) {
        let (idx, mask) = row_offsets(p.cols, PANEL_ROWS);
        for q in 0..p.cols / 4 {
            // SAFETY: quad q lies inside every staged row; 64 bytes at q·64
            // lie inside `levels`.
            unsafe {
                let v = gather(&p.staging, idx, mask, 4 * q);
                _mm512_storeu_si512(p.levels.as_mut_ptr().add(64 * q).cast(), v);
            }
        }
    }

    /// The levels of `rows` (the first `p.take` of them valid, `stride`
    /// bytes each, super-blocks of `kind`), read straight into the panel:
    /// one gather fetches the same 4 packed bytes of all 16 rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn levels_k(p: &mut Panel, kind: KindK, rows: &[u8], stride: usize) {
        let take = rows.len() / stride;
        assert!(rows.len() == take * stride && take <= PANEL_ROWS && take > 0);
        let (idx, mask) = row_offsets(stride, take);
        let bytes = k_bytes(kind);
        let (low4, low2, one) = (
            _mm512_set1_epi8(15),
            _mm512_set1_epi8(3),
            _mm512_set1_epi8(1),
        );
        let levels = p.levels.as_mut_ptr();
        // SAFETY (stores): value k's quad is at levels[16·k..], k < cols.
        let put =
            |k: usize, v: __m512i| unsafe { _mm512_storeu_si512(levels.add(16 * k).cast(), v) };
        for s in 0..p.cols / 256 {
            let (sb, k0) = (s * bytes, 256 * s);
            // SAFETY (gathers): every offset + 4 lies inside the super-block.
            match kind {
                KindK::Q4K | KindK::Q5K => {
                    let (qs, qh) = if kind == KindK::Q4K {
                        (16, 0)
                    } else {
                        (48, 16)
                    };
                    for l in (0..32).step_by(4) {
                        let h = if kind == KindK::Q5K {
                            unsafe { gather(rows, idx, mask, sb + qh + l) }
                        } else {
                            _mm512_setzero_si512()
                        };
                        for j in 0..4 {
                            let x = unsafe { gather(rows, idx, mask, sb + qs + 32 * j + l) };
                            let mut lo = _mm512_and_si512(x, low4);
                            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low4);
                            if kind == KindK::Q5K {
                                // The fifth bits of chunk j: bit 2j (low), 2j + 1 (high).
                                let b = |shift: u32| {
                                    let v = _mm512_srl_epi16(h, _mm_cvtsi32_si128(shift as i32));
                                    _mm512_slli_epi16::<4>(_mm512_and_si512(v, one))
                                };
                                lo = _mm512_or_si512(lo, b(2 * j as u32));
                                hi = _mm512_or_si512(hi, b(2 * j as u32 + 1));
                            }
                            put(k0 + 64 * j + l, lo);
                            put(k0 + 64 * j + 32 + l, hi);
                        }
                    }
                }
                KindK::Q6K => {
                    for n in 0..2 {
                        let (ql, qh, k) = (sb + 64 * n, sb + 128 + 32 * n, k0 + 128 * n);
                        for l in (0..32).step_by(4) {
                            let (a, b, h) = unsafe {
                                (
                                    gather(rows, idx, mask, ql + l),
                                    gather(rows, idx, mask, ql + 32 + l),
                                    gather(rows, idx, mask, qh + l),
                                )
                            };
                            let hi2 =
                                |v: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(v, low2));
                            let a_hi = _mm512_and_si512(_mm512_srli_epi16::<4>(a), low4);
                            let b_hi = _mm512_and_si512(_mm512_srli_epi16::<4>(b), low4);
                            put(k + l, _mm512_or_si512(_mm512_and_si512(a, low4), hi2(h)));
                            put(
                                k + 32 + l,
                                _mm512_or_si512(
                                    _mm512_and_si512(b, low4),
                                    hi2(_mm512_srli_epi16::<2>(h)),
                                ),
                            );
                            put(
                                k + 64 + l,
                                _mm512_or_si512(a_hi, hi2(_mm512_srli_epi16::<4>(h))),
                            );
                            put(
                                k + 96 + l,
                                _mm512_or_si512(b_hi, hi2(_mm512_srli_epi16::<6>(h))),
                            );
                        }
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn dispatch(
        p: &Panel,
        acts: &QuantizedActs,
        sums: &[f32],
        at: Block,
        tn: usize,
        out: &mut [f32],
    ) {
        macro_rules! by_t {
            ($g:literal) => {
                // SAFETY (all arms): same features and bounds as the caller's.
                unsafe {
                    match tn {
                        1 => rows_times::<1, $g>(p, acts, sums, at, out),
                        2 => rows_times::<2, $g>(p, acts, sums, at, out),
                        3 => rows_times::<3, $g>(p, acts, sums, at, out),
                        4 => rows_times::<4, $g>(p, acts, sums, at, out),
                        5 => rows_times::<5, $g>(p, acts, sums, at, out),
                        6 => rows_times::<6, $g>(p, acts, sums, at, out),
                        7 => rows_times::<7, $g>(p, acts, sums, at, out),
                        _ => rows_times::<8, $g>(p, acts, sums, at, out),
                    }
                }
            };
        }
        if p.sub == 16 {
            by_t!(16)
        } else {
            by_t!(32)
        }
    }

    /// `out[t, i0 + r] = Σ_c acts[t, c] · W[r, c]` for the panel's rows `r`
    /// and the `T` activation rows from `at.t0`, with sub-blocks of `G`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn rows_times<const T: usize, const G: usize>(
        p: &Panel,
        acts: &QuantizedActs,
        sums: &[f32],
        at: Block,
        out: &mut [f32],
    ) {
        let cols = p.cols;
        let block = acts.block.values();
        let (per_block, groups) = (block / G, cols / G);
        assert!(at.t0 + T <= acts.n && p.levels.len() == cols * PANEL_ROWS);
        assert!(sums.len() == acts.n * groups && p.scale.len() == groups * PANEL_ROWS);
        let qrows: [&[i8]; T] = std::array::from_fn(|k| acts.row(at.t0 + k));
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..cols / block {
            let mut part = [_mm512_setzero_ps(); T];
            for j in b * per_block..(b + 1) * per_block {
                let mut isum = [_mm512_setzero_si512(); T];
                for q in 0..G / 4 {
                    let c = j * G + 4 * q;
                    // SAFETY: 64 bytes of levels at quad c / 4, inside `levels`
                    // ([cols / 4][16][4]) as asserted above.
                    let w = unsafe { _mm512_loadu_si512(p.levels.as_ptr().add(c * 16).cast()) };
                    for k in 0..T {
                        // SAFETY: c + 4 ≤ cols, the length of every row.
                        let four =
                            unsafe { qrows[k].as_ptr().add(c).cast::<i32>().read_unaligned() };
                        isum[k] = _mm512_dpbusd_epi32(isum[k], w, _mm512_set1_epi32(four));
                    }
                }
                // SAFETY: 16 f32s of group j, inside `scale` and `off`.
                let (sv, ov) = unsafe {
                    (
                        _mm512_loadu_ps(p.scale.as_ptr().add(j * PANEL_ROWS)),
                        _mm512_loadu_ps(p.off.as_ptr().add(j * PANEL_ROWS)),
                    )
                };
                for k in 0..T {
                    let asum = _mm512_set1_ps(sums[(at.t0 + k) * groups + j]);
                    part[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[k]), sv, part[k]);
                    part[k] = _mm512_fnmadd_ps(ov, asum, part[k]);
                }
            }
            for k in 0..T {
                let da = _mm512_set1_ps(acts.scale(at.t0 + k, b));
                acc[k] = _mm512_fmadd_ps(part[k], da, acc[k]);
            }
        }
        let mask = lanes(at.take);
        for (k, acc) in acc.iter().enumerate() {
            let start = (at.t0 + k) * at.len + at.i0;
            assert!(start + at.take <= out.len());
            // SAFETY: the mask writes `take` lanes, inside `out` as asserted.
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(start), mask, *acc) };
        }
    }
}
