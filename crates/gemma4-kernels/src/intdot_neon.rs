//! The integer kernels of [`crate::intdot`] on aarch64: a weight block's
//! levels are unpacked into signed bytes in NEON registers and meet the
//! activations' bytes in 16-byte products, either NEON's widening
//! multiplies (`smull` into 16-bit lanes, pairwise added into 32-bit ones)
//! or, where the CPU has the dot-product extension, `sdot` (four 4-byte
//! dot products an instruction). llama.cpp's ggml-cpu does the same with
//! `vdotq_s32` (its `ggml_vec_dot_q4_0_q8_0` and kin). Where the CPU has
//! the 8-bit matrix multiplies (i8mm), two weight rows meet two activation
//! rows in `smmla` (a 2×8 by 8×2 product an instruction), as llama.cpp's
//! kernels do for two rows at a time.
//!
//! The integer sums are exact whichever instruction forms them, and the
//! float steps are the portable kernel's own ([`intdot::fold32`],
//! [`intdot::fold_k`]) in its order, so every level gives the portable
//! kernel's bits, and a row of a several-row product is its one-row
//! product.

use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

use crate::acts::QuantizedActs;
use crate::dispatch::Level;
use crate::intdot::{self, with_kind32, Kind32, KindK, Row, GROUP};

/// How 16 signed bytes times 16 signed bytes are added into four 32-bit
/// lanes (which lane gets which products differs between the two; only
/// the lanes' total is used).
trait Dot {
    /// `acc` plus the products of `a` and `b`.
    ///
    /// # Safety
    /// The CPU must have the instructions the implementation uses.
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
}

/// NEON's widening multiplies: every aarch64 CPU has them. A product of two
/// bytes fits 16 bits, and the pairwise add widens before adding.
struct Widening;

impl Dot for Widening {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let hi = vmull_high_s8(a, b);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// The dot-product extension's `sdot` (Armv8.2's FEAT_DotProd: Cortex-A76
/// and Neoverse N1 on, Apple M1 on). Written as an instruction because
/// Rust's `vdotq_s32` is not stable yet.
struct Sdot;

impl Dot for Sdot {
    #[inline]
    #[target_feature(enable = "dotprod")]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: the function's target feature (which callers guarantee)
        // makes `sdot` available; it touches only registers.
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }
}

/// The 16 bytes at `p` as signed bytes.
#[inline(always)]
unsafe fn load(p: *const u8) -> int8x16_t {
    vld1q_s8(p.cast())
}

/// Low and high nibbles of the 16 bytes at `p`, less `offset`: values
/// 0–15 and 16–31 of a 32-value block.
#[inline(always)]
unsafe fn nibbles(p: *const u8, offset: i8) -> (int8x16_t, int8x16_t) {
    let q = vld1q_u8(p);
    let lo = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15)));
    let hi = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
    let off = vdupq_n_s8(offset);
    (vsubq_s8(lo, off), vsubq_s8(hi, off))
}

/// 16 where bit `i` of the 16 bits is set, for `i` in 0..16.
#[inline(always)]
unsafe fn bits_as_16(bits: u16) -> int8x16_t {
    const MASK: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    let set = vtstq_u8(bytes, vld1q_u8(MASK.as_ptr()));
    vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(16)))
}

/// IEEE half → f32 with the conversion instruction (exact, as
/// [`crate::f16_to_f32`] is, for every value but a NaN's payload).
#[inline(always)]
unsafe fn half_to_f32(p: *const u8) -> f32 {
    let bits = p.cast::<u16>().read_unaligned().to_le();
    let out: f32;
    // SAFETY: `fcvt` is part of every aarch64 CPU's floating point; it
    // touches only registers.
    asm!(
        "fcvt {out:s}, {h:h}",
        out = lateout(vreg) out,
        h = in(vreg) bits,
        options(pure, nomem, nostack, preserves_flags)
    );
    out
}

/// A weight row of 32-value blocks checked once for the kernels, which
/// then read it unchecked.
#[derive(Clone, Copy)]
struct Row32<'a, const K: usize> {
    row: &'a Row<'a>,
}

impl<'a, const K: usize> Row32<'a, K> {
    /// `row` as the kernels read it for `blocks` blocks; panics if it is short.
    fn new(row: &'a Row<'a>, blocks: usize) -> Self {
        let kind = Kind32::ALL[K];
        assert!(
            row.data.len() >= blocks * kind.bytes(),
            "{kind:?} row too short"
        );
        assert!(
            kind != Kind32::Q4 || row.scales.len() >= blocks,
            "q4 row without its scales"
        );
        Self { row }
    }

    /// Block `b` (below the `blocks` checked) as [`intdot::decode32`] gives
    /// it: its 32 levels (values 0–15, 16–31) and `(d, m)`.
    #[inline(always)]
    unsafe fn decode(self, b: usize) -> (int8x16_t, int8x16_t, (f32, f32)) {
        let kind = Kind32::ALL[K];
        let p = self.row.data.as_ptr().add(b * kind.bytes());
        let fifth = |at: usize| {
            let qh = p.add(at).cast::<u32>().read_unaligned().to_le();
            (bits_as_16(qh as u16), bits_as_16((qh >> 16) as u16))
        };
        match kind {
            Kind32::Q8_0 => (load(p.add(2)), load(p.add(18)), (half_to_f32(p), 0.0)),
            Kind32::Int8 => (load(p), load(p.add(16)), (self.row.scale, 0.0)),
            Kind32::Q4_0 => {
                let (lo, hi) = nibbles(p.add(2), 8);
                (lo, hi, (half_to_f32(p), 0.0))
            }
            Kind32::Q4 => {
                let (lo, hi) = nibbles(p, 8);
                (lo, hi, (*self.row.scales.get_unchecked(b), 0.0))
            }
            Kind32::Q4_1 => {
                let (lo, hi) = nibbles(p.add(4), 0);
                (lo, hi, (half_to_f32(p), half_to_f32(p.add(2))))
            }
            Kind32::Q5_0 => {
                let (lo, hi) = nibbles(p.add(6), 16);
                let (f0, f1) = fifth(2);
                (vaddq_s8(lo, f0), vaddq_s8(hi, f1), (half_to_f32(p), 0.0))
            }
            Kind32::Q5_1 => {
                let (lo, hi) = nibbles(p.add(8), 0);
                let (f0, f1) = fifth(4);
                let dm = (half_to_f32(p), half_to_f32(p.add(2)));
                (vaddq_s8(lo, f0), vaddq_s8(hi, f1), dm)
            }
        }
    }
}

/// One activation row as the 32-value kernels read it: its bytes, block
/// scales and per-16 sums, checked once.
#[derive(Clone, Copy)]
struct Acts32<'a> {
    qs: &'a [i8],
    scales: &'a [f32],
    sums: &'a [i32],
}

impl<'a> Acts32<'a> {
    fn new(acts: &'a QuantizedActs, t: usize) -> Self {
        let blocks = acts.cols / 32;
        Self {
            qs: acts.row(t),
            scales: &acts.scales[t * blocks..(t + 1) * blocks],
            sums: &acts.sums[t * 2 * blocks..(t + 1) * 2 * blocks],
        }
    }

    /// Every activation row of `acts`.
    fn all(acts: &'a QuantizedActs) -> Vec<Self> {
        (0..acts.n).map(|t| Self::new(acts, t)).collect()
    }

    /// Block `b`'s 16-byte halves (`b` below the row's blocks).
    #[inline(always)]
    unsafe fn block(self, b: usize) -> (int8x16_t, int8x16_t) {
        let q = self.qs.as_ptr().add(32 * b).cast::<u8>();
        (load(q), load(q.add(16)))
    }

    /// Folds the integer sum `isum` of block `b` into `acc`.
    #[inline(always)]
    unsafe fn fold(self, acc: &mut f32, b: usize, dm: (f32, f32), isum: i32) {
        let qsum = || *self.sums.get_unchecked(2 * b) + *self.sums.get_unchecked(2 * b + 1);
        intdot::fold32(acc, *self.scales.get_unchecked(b), dm, isum, qsum);
    }

    /// The integer sum of a decoded block's halves with block `b`.
    #[inline(always)]
    unsafe fn sum<D: Dot>(self, (w0, w1): (int8x16_t, int8x16_t), b: usize) -> i32 {
        let (x0, x1) = self.block(b);
        vaddvq_s32(D::dot(D::dot(vdupq_n_s32(0), w0, x0), w1, x1))
    }
}

/// `out[t · len + i] = Σ w · x` of weight row `w` (the range's row `i`)
/// with every activation row, [`GROUP`] rows at a time, each row's sum
/// folded block by block as the portable kernel folds it.
#[inline(always)]
unsafe fn row32<D: Dot, const K: usize>(
    w: Row32<K>,
    acts: &[Acts32],
    blocks: usize,
    i: usize,
    len: usize,
    out: &mut [f32],
) {
    for (g, rows) in acts.chunks(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for b in 0..blocks {
            let (w0, w1, dm) = w.decode(b);
            for (acc, x) in acc.iter_mut().zip(rows) {
                x.fold(acc, b, dm, x.sum::<D>((w0, w1), b));
            }
        }
        for (k, acc) in acc[..rows.len()].iter().enumerate() {
            out[(GROUP * g + k) * len + i] = *acc;
        }
    }
}

/// Four weight rows against one activation row `x`: the rows' integer
/// sums gathered into the lanes of one register, whose float steps are
/// then each lane's [`intdot::fold32`], in its order (and a minimum's
/// term added only in the lanes whose `m` is not 0, as the portable kernel
/// adds it), so each lane gets the portable kernel's bits.
#[inline(always)]
unsafe fn quad32<D: Dot, const K: usize>(w: [Row32<K>; 4], x: Acts32, blocks: usize) -> [f32; 4] {
    let zero = vdupq_n_s32(0);
    let mut acc = vdupq_n_f32(0.0);
    for b in 0..blocks {
        let (x0, x1) = x.block(b);
        let (mut dots, mut d, mut m) = ([zero; 4], [0f32; 4], [0f32; 4]);
        for r in 0..4 {
            let (w0, w1, (dr, mr)) = w[r].decode(b);
            dots[r] = D::dot(D::dot(zero, w0, x0), w1, x1);
            (d[r], m[r]) = (dr, mr);
        }
        let isum = vpaddq_s32(vpaddq_s32(dots[0], dots[1]), vpaddq_s32(dots[2], dots[3]));
        let da = *x.scales.get_unchecked(b);
        let part = vmulq_f32(vld1q_f32(d.as_ptr()), vcvtq_f32_s32(isum));
        acc = vaddq_f32(acc, vmulq_n_f32(part, da));
        if Kind32::ALL[K].affine() {
            let qsum = *x.sums.get_unchecked(2 * b) + *x.sums.get_unchecked(2 * b + 1);
            let m = vld1q_f32(m.as_ptr());
            let term = vmulq_n_f32(vmulq_n_f32(m, da), qsum as f32);
            let zero_m = vceqq_f32(m, vdupq_n_f32(0.0));
            acc = vbslq_f32(zero_m, acc, vaddq_f32(acc, term));
        }
    }
    let mut lanes = [0f32; 4];
    vst1q_f32(lanes.as_mut_ptr(), acc);
    lanes
}

/// Weight rows `rows` (skipping the first `skip`): with one activation row,
/// four at a time; otherwise, and for the last few, one at a time.
#[inline(always)]
unsafe fn rows32<'a, D: Dot>(
    kind: Kind32,
    rows: Range<usize>,
    skip: usize,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let (blocks, len) = (acts.cols / 32, rows.len());
    let views = Acts32::all(acts);
    with_kind32!(kind, K => {
        let mut i = skip;
        if acts.n == 1 {
            while i + 4 <= len {
                let r = rows.start + i;
                let ws = [row_of(r), row_of(r + 1), row_of(r + 2), row_of(r + 3)];
                let quad = ws.each_ref().map(|w| Row32::<K>::new(w, blocks));
                let sums = quad32::<D, K>(quad, views[0], blocks);
                out[i..i + 4].copy_from_slice(&sums);
                i += 4;
            }
        }
        for (i, r) in rows.enumerate().skip(i) {
            let row = row_of(r);
            row32::<D, K>(Row32::new(&row, blocks), &views, blocks, i, len, out);
        }
    })
}

#[target_feature(enable = "dotprod")]
unsafe fn rows32_sdot<'a>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    rows32::<Sdot>(kind, rows, 0, row_of, acts, out)
}

/// Pairs of weight rows through `smmla` when there are two activation
/// rows or more, then a last odd row through `sdot`.
#[target_feature(enable = "dotprod,i8mm")]
unsafe fn rows32_mmla<'a>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let (blocks, len) = (acts.cols / 32, rows.len());
    if acts.n < 2 {
        return rows32::<Sdot>(kind, rows, 0, row_of, acts, out);
    }
    let views = Acts32::all(acts);
    with_kind32!(kind, K => {
        for (pair, r) in rows.clone().step_by(2).take(len / 2).enumerate() {
            let (a, b) = (row_of(r), row_of(r + 1));
            let w = [Row32::<K>::new(&a, blocks), Row32::<K>::new(&b, blocks)];
            pair32_mmla(w, &views, blocks, 2 * pair, len, out);
        }
    });
    rows32::<Sdot>(kind, rows, len / 2 * 2, row_of, acts, out)
}

/// `out[t · rows.len() + i] = Σ_c acts[t, c] · W[rows.start + i, c]` for a
/// matrix of 32-value blocks whose row `r` is `row_of(r)`, with the
/// kernels of `level` (one the CPU has, not `portable`).
pub(crate) fn matrix32<'a>(
    level: Level,
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    // SAFETY: `level` is one the CPU has; NEON is part of every aarch64 CPU.
    unsafe {
        match level {
            Level::I8mm => rows32_mmla(kind, rows, row_of, acts, out),
            Level::Dotprod => rows32_sdot(kind, rows, row_of, acts, out),
            _ => rows32::<Widening>(kind, rows, 0, row_of, acts, out),
        }
    }
}

/// `acc` plus the 2×2 integer products over 16 values of two weight rows
/// (`w0`, `w1`) and two activation rows (`a0`, `a1`), in the lanes
/// `[w0·a0, w0·a1, w1·a0, w1·a1]`.
#[inline]
#[target_feature(enable = "i8mm")]
unsafe fn mmla16(acc: int32x4_t, w: [int8x16_t; 2], a: [int8x16_t; 2]) -> int32x4_t {
    // `smmla` multiplies 2×8 by 8×2: a register holds two rows' 8 bytes,
    // so the 16 values go through in two halves.
    let (w0, w1) = (vreinterpretq_s64_s8(w[0]), vreinterpretq_s64_s8(w[1]));
    let (a0, a1) = (vreinterpretq_s64_s8(a[0]), vreinterpretq_s64_s8(a[1]));
    let mut acc = acc;
    for (wm, am) in [
        (vzip1q_s64(w0, w1), vzip1q_s64(a0, a1)),
        (vzip2q_s64(w0, w1), vzip2q_s64(a0, a1)),
    ] {
        // SAFETY: the function's target feature (which callers guarantee)
        // makes `smmla` available; it touches only registers.
        asm!(
            "smmla {acc:v}.4s, {w:v}.16b, {a:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) vreinterpretq_s8_s64(wm),
            a = in(vreg) vreinterpretq_s8_s64(am),
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// The four lanes of `v`.
#[inline(always)]
unsafe fn lanes(v: int32x4_t) -> [i32; 4] {
    let mut l = [0i32; 4];
    vst1q_s32(l.as_mut_ptr(), v);
    l
}

/// Weight rows `w` (the range's rows `i`, `i + 1`) against every
/// activation row, into `out` (`[n, len]`): pairs of activation rows in
/// `smmla`, a last odd one in `sdot`; each (row, activation row) sum
/// folded block by block as the portable kernel folds it.
#[inline]
#[target_feature(enable = "dotprod,i8mm")]
unsafe fn pair32_mmla<const K: usize>(
    w: [Row32<K>; 2],
    acts: &[Acts32],
    blocks: usize,
    i: usize,
    len: usize,
    out: &mut [f32],
) {
    for (g, rows) in acts.chunks(GROUP).enumerate() {
        // acc[r][k]: weight row i + r, activation row GROUP · g + k.
        let mut acc = [[0f32; GROUP]; 2];
        for b in 0..blocks {
            let (a0, a1, dm0) = w[0].decode(b);
            let (b0, b1, dm1) = w[1].decode(b);
            let dm = [dm0, dm1];
            let mut k = 0;
            while k + 1 < rows.len() {
                let (x, y) = (rows[k], rows[k + 1]);
                let ((x0, x1), (y0, y1)) = (x.block(b), y.block(b));
                let lo = mmla16(vdupq_n_s32(0), [a0, b0], [x0, y0]);
                let sums = lanes(mmla16(lo, [a1, b1], [x1, y1]));
                x.fold(&mut acc[0][k], b, dm[0], sums[0]);
                y.fold(&mut acc[0][k + 1], b, dm[0], sums[1]);
                x.fold(&mut acc[1][k], b, dm[1], sums[2]);
                y.fold(&mut acc[1][k + 1], b, dm[1], sums[3]);
                k += 2;
            }
            if let Some(x) = rows.get(k) {
                for (r, halves) in [(a0, a1), (b0, b1)].into_iter().enumerate() {
                    x.fold(&mut acc[r][k], b, dm[r], x.sum::<Sdot>(halves, b));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (k, acc) in acc[..rows.len()].iter().enumerate() {
                out[(GROUP * g + k) * len + i + r] = *acc;
            }
        }
    }
}

/// Super-block `blk`'s 256 unsigned levels into `u`, as
/// [`intdot::decode_k`] lays them out, sixteen at a time.
#[inline(always)]
unsafe fn unpack_k(kind: KindK, blk: &[u8], u: &mut [u8; 256]) {
    let o = u.as_mut_ptr();
    let low = vdupq_n_u8(15);
    match kind {
        KindK::Q4K | KindK::Q5K => {
            let (qs, qh) = if kind == KindK::Q4K {
                (blk[16..144].as_ptr(), None)
            } else {
                (blk[48..176].as_ptr(), Some(blk[16..48].as_ptr()))
            };
            for j in 0..4 {
                for half in 0..2 {
                    let q = vld1q_u8(qs.add(32 * j + 16 * half));
                    let (mut lo, mut hi) = (vandq_u8(q, low), vshrq_n_u8(q, 4));
                    if let Some(qh) = qh {
                        let h = vld1q_u8(qh.add(16 * half));
                        let sixteen = vdupq_n_u8(16);
                        let bit = |i: usize| vandq_u8(vtstq_u8(h, vdupq_n_u8(1 << i)), sixteen);
                        lo = vorrq_u8(lo, bit(2 * j));
                        hi = vorrq_u8(hi, bit(2 * j + 1));
                    }
                    vst1q_u8(o.add(64 * j + 16 * half), lo);
                    vst1q_u8(o.add(64 * j + 32 + 16 * half), hi);
                }
            }
        }
        KindK::Q6K => {
            let top = vdupq_n_u8(0x30);
            for n in 0..2 {
                let ql = blk[64 * n..64 * n + 64].as_ptr();
                let qh = blk[128 + 32 * n..128 + 32 * n + 32].as_ptr();
                for half in 0..2 {
                    let l = 16 * half;
                    let (a, b) = (vld1q_u8(ql.add(l)), vld1q_u8(ql.add(l + 32)));
                    let h = vld1q_u8(qh.add(l));
                    let at = o.add(128 * n + l);
                    // Bits 2i and 2i + 1 of `h` become bits 4 and 5 of level i.
                    let h0 = vandq_u8(vshlq_n_u8(h, 4), top);
                    let h1 = vandq_u8(vshlq_n_u8(h, 2), top);
                    let h2 = vandq_u8(h, top);
                    let h3 = vandq_u8(vshrq_n_u8(h, 2), top);
                    vst1q_u8(at, vorrq_u8(vandq_u8(a, low), h0));
                    vst1q_u8(at.add(32), vorrq_u8(vandq_u8(b, low), h1));
                    vst1q_u8(at.add(64), vorrq_u8(vshrq_n_u8(a, 4), h2));
                    vst1q_u8(at.add(96), vorrq_u8(vshrq_n_u8(b, 4), h3));
                }
            }
        }
    }
}

/// `out[k] = Σ w · x` of one row of k-quant super-blocks with the
/// activation rows `ts` (at most [`GROUP`]).
#[inline(always)]
unsafe fn dots_k_body<D: Dot>(
    kind: KindK,
    row: &[u8],
    acts: &QuantizedActs,
    ts: Range<usize>,
    out: &mut [f32],
) {
    let mut acc = [0f32; GROUP];
    let (mut u, mut sc, mut mn) = ([0u8; 256], [0i32; 16], [0i32; 16]);
    let offset = if kind == KindK::Q6K { 32 } else { 0 };
    for (s, blk) in row.chunks_exact(intdot::k_bytes(kind)).enumerate() {
        unpack_k(kind, blk, &mut u);
        let (d, dmin) = intdot::scales_k(kind, blk, &mut sc, &mut mn);
        for (k, t) in ts.clone().enumerate() {
            let (isum, msum) = sums_k::<D>((&u, &sc, &mn), offset, acts, t, s);
            intdot::fold_k(&mut acc[k], acts.scale(t, s), (d, dmin), isum, msum);
        }
    }
    out[..ts.len()].copy_from_slice(&acc[..ts.len()]);
}

/// 16 levels of an unpacked super-block, from value `16 · g`. Levels are
/// below 64: as signed bytes they are themselves.
#[inline(always)]
unsafe fn levels16(u: &[u8; 256], g: usize) -> int8x16_t {
    vreinterpretq_s8_u8(vld1q_u8(u[16 * g..16 * g + 16].as_ptr()))
}

/// Super-block `s` of activation row `t` against unpacked levels, per-16
/// scales and mins: the sums over the levels (less `offset` each: Q6_K's
/// 32) and over the mins, the portable kernel's integers (formed four
/// sub-blocks to a register: the order of integer additions changes
/// nothing).
#[inline(always)]
unsafe fn sums_k<D: Dot>(
    (u, sc, mn): (&[u8; 256], &[i32; 16], &[i32; 16]),
    offset: i32,
    acts: &QuantizedActs,
    t: usize,
    s: usize,
) -> (i32, i32) {
    let q = acts.row(t)[256 * s..256 * s + 256].as_ptr().cast::<u8>();
    let sums = acts.sums[t * (acts.cols / 16) + 16 * s..][..16].as_ptr();
    let (mut isum, mut msum) = (vdupq_n_s32(0), vdupq_n_s32(0));
    for g in (0..16).step_by(4) {
        let dot = |g: usize| D::dot(vdupq_n_s32(0), levels16(u, g), load(q.add(16 * g)));
        // Pairwise adds leave sub-block g + j's sum in lane j.
        let lo = vpaddq_s32(dot(g), dot(g + 1));
        let hi = vpaddq_s32(dot(g + 2), dot(g + 3));
        let parts = vpaddq_s32(lo, hi);
        let gsum = vld1q_s32(sums.add(g));
        let levels = vsubq_s32(parts, vmulq_n_s32(gsum, offset));
        isum = vmlaq_s32(isum, vld1q_s32(sc[g..g + 4].as_ptr()), levels);
        msum = vmlaq_s32(msum, vld1q_s32(mn[g..g + 4].as_ptr()), gsum);
    }
    (vaddvq_s32(isum), vaddvq_s32(msum))
}

#[target_feature(enable = "dotprod")]
unsafe fn dots_k_sdot(
    kind: KindK,
    row: &[u8],
    acts: &QuantizedActs,
    ts: Range<usize>,
    out: &mut [f32],
) {
    dots_k_body::<Sdot>(kind, row, acts, ts, out)
}

/// [`intdot::dots_k_portable`] with the kernels of `level` (`neon`, or
/// `sdot` from `dotprod` on; the CPU must have them).
fn dots_k(
    level: Level,
    kind: KindK,
    row: &[u8],
    acts: &QuantizedActs,
    ts: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: `level` is one the CPU has; NEON is part of every aarch64 CPU.
    unsafe {
        match level {
            Level::Dotprod | Level::I8mm => dots_k_sdot(kind, row, acts, ts, out),
            _ => dots_k_body::<Widening>(kind, row, acts, ts, out),
        }
    }
}

/// [`matrix32`] for a matrix of k-quant super-blocks stored row after row
/// in `data`.
pub(crate) fn matrix_k(
    level: Level,
    kind: KindK,
    rows: Range<usize>,
    data: &[u8],
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let (n, len) = (acts.n, rows.len());
    let width = acts.cols / 256 * intdot::k_bytes(kind);
    let row_of = |r: usize| &data[r * width..(r + 1) * width];
    let mut i = 0;
    if level == Level::I8mm && n >= 2 {
        // SAFETY: `level` says the CPU has i8mm and dotprod.
        for (pair, r) in rows.clone().step_by(2).take(len / 2).enumerate() {
            unsafe { pair_k_mmla(kind, [row_of(r), row_of(r + 1)], acts, 2 * pair, len, out) };
        }
        i = len / 2 * 2;
    }
    for (i, r) in rows.enumerate().skip(i) {
        intdot::for_groups(n, len, i, out, |ts, part| {
            dots_k(level, kind, row_of(r), acts, ts, part)
        });
    }
}

/// A weight row's super-block, unpacked: levels, per-16 scales and mins,
/// `(d, dmin)`.
#[derive(Clone, Copy)]
struct UnpackedK {
    u: [u8; 256],
    sc: [i32; 16],
    mn: [i32; 16],
    dm: (f32, f32),
}

/// [`pair32_mmla`] for k-quant rows: per 16 values two `smmla` give the
/// four (weight row, activation row) sums, scaled by each row's
/// sub-block scale in 32-bit lanes.
#[target_feature(enable = "dotprod,i8mm")]
unsafe fn pair_k_mmla(
    kind: KindK,
    w: [&[u8]; 2],
    acts: &QuantizedActs,
    i: usize,
    len: usize,
    out: &mut [f32],
) {
    let n = acts.n;
    let bytes = intdot::k_bytes(kind);
    let offset = if kind == KindK::Q6K { 32 } else { 0 };
    let mut p = [UnpackedK {
        u: [0; 256],
        sc: [0; 16],
        mn: [0; 16],
        dm: (0.0, 0.0),
    }; 2];
    for t0 in (0..n).step_by(GROUP) {
        let ts = t0..(t0 + GROUP).min(n);
        let mut acc = [[0f32; GROUP]; 2];
        for s in 0..acts.cols / 256 {
            for (row, w) in p.iter_mut().zip(w) {
                let blk = &w[s * bytes..(s + 1) * bytes];
                unpack_k(kind, blk, &mut row.u);
                row.dm = intdot::scales_k(kind, blk, &mut row.sc, &mut row.mn);
            }
            let mut t = ts.start;
            while t + 1 < ts.end {
                let at = |t: usize| acts.row(t)[256 * s..256 * s + 256].as_ptr().cast::<u8>();
                let (qa, qb) = (at(t), at(t + 1));
                let (mut isum, mut msum) = (vdupq_n_s32(0), vdupq_n_s32(0));
                for g in 0..16 {
                    let (a, b) = (load(qa.add(16 * g)), load(qb.add(16 * g)));
                    let parts = mmla16(
                        vdupq_n_s32(0),
                        [levels16(&p[0].u, g), levels16(&p[1].u, g)],
                        [a, b],
                    );
                    let sc = [p[0].sc[g], p[0].sc[g], p[1].sc[g], p[1].sc[g]];
                    let mn = [p[0].mn[g], p[0].mn[g], p[1].mn[g], p[1].mn[g]];
                    let (ga, gb) = (acts.sum16(t, 16 * s + g), acts.sum16(t + 1, 16 * s + g));
                    let gsum = vld1q_s32([ga, gb, ga, gb].as_ptr());
                    let parts = vsubq_s32(parts, vmulq_n_s32(gsum, offset));
                    isum = vmlaq_s32(isum, vld1q_s32(sc.as_ptr()), parts);
                    msum = vmlaq_s32(msum, vld1q_s32(mn.as_ptr()), gsum);
                }
                let (isum, msum) = (lanes(isum), lanes(msum));
                for (lane, (r, k)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                    let da = acts.scale(t + k, s);
                    intdot::fold_k(&mut acc[r][t - t0 + k], da, p[r].dm, isum[lane], msum[lane]);
                }
                t += 2;
            }
            if t < ts.end {
                for (acc, row) in acc.iter_mut().zip(&p) {
                    let unpacked = (&row.u, &row.sc, &row.mn);
                    let (isum, msum) = sums_k::<Sdot>(unpacked, offset, acts, t, s);
                    intdot::fold_k(&mut acc[t - t0], acts.scale(t, s), row.dm, isum, msum);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (k, t) in ts.clone().enumerate() {
                out[t * len + i + r] = acc[k];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acts::ActBlock;
    use crate::testing::{random_blocks, values};

    /// Where each format keeps its f16 scales.
    fn halves32(kind: Kind32) -> &'static [usize] {
        match kind {
            Kind32::Q8_0 | Kind32::Q4_0 | Kind32::Q5_0 => &[0],
            Kind32::Q4_1 | Kind32::Q5_1 => &[0, 2],
            Kind32::Int8 | Kind32::Q4 => &[],
        }
    }

    fn halves_k(kind: KindK) -> &'static [usize] {
        match kind {
            KindK::Q4K | KindK::Q5K => &[0, 2],
            KindK::Q6K => &[208],
        }
    }

    /// The NEON levels this CPU can run.
    fn levels() -> Vec<Level> {
        let here = crate::dispatch::level();
        let levels: Vec<Level> = Level::ALL
            .iter()
            .copied()
            .filter(|&l| l != Level::Portable && l <= here)
            .collect();
        assert!(!levels.is_empty() || here == Level::Portable);
        levels
    }

    fn same_bits(what: &str, got: &[f32], want: &[f32]) {
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "{what} [{i}]: {a} vs the portable kernel's {b}"
            );
        }
    }

    /// The conversion instruction gives `f16_to_f32`'s value for every
    /// half but the NaNs (whose payloads the scales never carry).
    #[test]
    fn the_conversion_instruction_widens_every_half_exactly() {
        for h in 0..=u16::MAX {
            let want = crate::f16_to_f32(h);
            // SAFETY: two readable bytes.
            let got = unsafe { half_to_f32(h.to_le_bytes().as_ptr()) };
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }

    /// The portable kernel's `[n, rows]` product, row by row.
    fn portable(rows: usize, n: usize, each: impl Fn(usize, Range<usize>, &mut [f32])) -> Vec<f32> {
        let mut want = vec![0f32; n * rows];
        for i in 0..rows {
            intdot::for_groups(n, rows, i, &mut want, |ts, part| each(i, ts, part));
        }
        assert!(want.iter().all(|v| *v != 0.0));
        want
    }

    /// Random weight bytes (Q8_0's −128 included) against activations that
    /// reach ±127, an odd number of weight rows (pairs and a last one for
    /// `smmla`) and one to seven activation rows: every level's products
    /// are the portable kernel's, bit for bit.
    #[test]
    fn every_level_gives_the_portable_kernels_bits() {
        let (rows, cols) = (5, 1024);
        let scales = values(cols / 32, 3, 0.1);
        for n in [1, 2, 3, 4, 5, 7] {
            let x = values(n * cols, 5 + n as u64, 2.0);
            let acts32 = QuantizedActs::quantize(&x, n, cols, ActBlock::B32);
            let acts256 = QuantizedActs::quantize(&x, n, cols, ActBlock::B256);
            for (seed, kind) in Kind32::ALL.into_iter().enumerate() {
                let blocks = rows * cols / 32;
                let mut data = random_blocks(blocks, kind.bytes(), halves32(kind), seed as u64);
                if kind.affine() {
                    // Some minimums exactly 0: the term is then not added.
                    for blk in data.chunks_exact_mut(kind.bytes()).step_by(3) {
                        blk[2..4].fill(0);
                    }
                }
                let width = cols / 32 * kind.bytes();
                let row_of = |r: usize| Row {
                    data: &data[r * width..(r + 1) * width],
                    scales: &scales,
                    scale: 0.0123 * (r + 1) as f32,
                };
                let want = portable(rows, n, |i, ts, part| {
                    intdot::dots32_portable(kind, &row_of(i), &acts32, ts, part)
                });
                for &level in &levels() {
                    let mut got = vec![0f32; n * rows];
                    matrix32(level, kind, 0..rows, &row_of, &acts32, &mut got);
                    same_bits(&format!("{kind:?} {level:?} n={n}"), &got, &want);
                }
            }
            for (seed, kind) in KindK::ALL.into_iter().enumerate() {
                let (bytes, blocks) = (intdot::k_bytes(kind), rows * cols / 256);
                let data = random_blocks(blocks, bytes, halves_k(kind), 20 + seed as u64);
                let width = cols / 256 * bytes;
                let want = portable(rows, n, |i, ts, part| {
                    let row = &data[i * width..(i + 1) * width];
                    intdot::dots_k_portable(kind, row, &acts256, ts, part)
                });
                for &level in &levels() {
                    let mut got = vec![0f32; n * rows];
                    matrix_k(level, kind, 0..rows, &data, &acts256, &mut got);
                    same_bits(&format!("{kind:?} {level:?} n={n}"), &got, &want);
                }
            }
        }
    }
}
