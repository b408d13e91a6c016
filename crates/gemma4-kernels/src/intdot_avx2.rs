//! The integer dot products with AVX2 (the one-row decode of the 32-value
//! formats and the k-quant kernel also built with AVX-512 VNNI, a `VNNI`
//! const parameter choosing `vpdpbusd`/`vpdpwssd` sums): the
//! 8-bit products by `vpmaddubsw` (unsigned weight levels directly, signed
//! ones as |w| with the weight's sign moved onto the activation; −128 stays
//! 128 unsigned) and `vpmaddwd`,
//! the scales applied once per block and activation row. A weight block is
//! unpacked into registers once for up to [`GROUP`] activation rows; the
//! k-quants' levels are unpacked from their packed bytes with shifts and
//! masks, never through a byte array.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::acts::QuantizedActs;
use crate::intdot::{k_bytes, with_kind32, Kind32, KindK, Row, GROUP};

/// The two builds of a kernel written once with a `VNNI` const parameter:
/// `$avx2` compiled for AVX2, FMA and F16C, `$vnni` for AVX-512 F, BW, VL
/// and VNNI besides (`vpdpbusd` / `vpdpwssd` sums on the same 256-bit
/// registers), each calling `$body::<VNNI>` with the same arguments.
macro_rules! avx2_and_vnni {
    (
        $(#[$doc:meta])*
        pub unsafe fn $avx2:ident / $vnni:ident $(<$lt:lifetime>)? ($($arg:ident: $ty:ty),* $(,)?)
            => $body:ident
    ) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must have AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $avx2 $(<$lt>)? ($($arg: $ty),*) {
            $body::<false>($($arg),*)
        }

        #[doc = concat!("[`", stringify!($avx2), "`] built with AVX-512 VNNI.")]
        ///
        /// # Safety
        /// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn $vnni $(<$lt>)? ($($arg: $ty),*) {
            $body::<true>($($arg),*)
        }
    };
}

#[inline(always)]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// Runs the kernel's `step!(block, accumulators)` over blocks `0..blocks`,
/// even blocks into `even`, odd ones into `odd`, unrolled by hand: an
/// accumulator picked by `b & 1` lived on the stack, and each block waited
/// on the store of the one before last. (A macro: a closure does not
/// inherit the kernel's target features, and its intrinsics were calls.)
macro_rules! even_odd {
    ($blocks:expr, $step:ident, $even:expr, $odd:expr) => {{
        let mut b = 0;
        while b + 1 < $blocks {
            $step!(b, $even);
            $step!(b + 1, $odd);
            b += 2;
        }
        if b < $blocks {
            $step!(b, $even);
        }
    }};
}

/// Eight i32 sums of four products each: unsigned `u` by signed `a`.
#[inline(always)]
unsafe fn dot_u8(u: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

/// 16 bytes of nibbles as 32 bytes: the low nibbles, then the high ones (the
/// order [`decode32`] gives).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // The bytes in both lanes, the high lane shifted by a nibble: a load
    // and a shift, with no lane insert.
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let both = _mm256_srlv_epi64(q, _mm256_set_epi64x(4, 4, 0, 0));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// How far ahead of the block being read the weights are prefetched.
const PREFETCH_BYTES: usize = 1024;

/// The f16 at `p` in all eight lanes (F16C). Broadcast from a general
/// register, so that no instruction merges it into an older vector register
/// (an insert into whatever register was free made each block wait on the
/// previous block's accumulator).
#[inline(always)]
unsafe fn half8_at(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

/// The f16 at `p` as f32.
#[inline(always)]
unsafe fn half_at(p: *const u8) -> f32 {
    _mm256_cvtss_f32(half8_at(p))
}

/// The offset `o` of the kinds stored as unsigned levels `u` with signed
/// values `v = u − o` (0 for the others).
const fn level_offset(kind: Kind32) -> i8 {
    match kind {
        Kind32::Q4_0 | Kind32::Q4 => 8,
        Kind32::Q5_0 => 16,
        _ => 0,
    }
}

/// Block `b` of `row` as 32 bytes of levels as stored (unsigned for the
/// affine kinds and those with a [`level_offset`], else signed), `d` in all
/// lanes and `m`, with `w = d · (u − o) + m`. `VNNI`: inlined where AVX-512
/// (BW, VL) is enabled.
#[inline(always)]
unsafe fn levels32<const K: usize, const VNNI: bool>(
    row: &Row,
    b: usize,
) -> (__m256i, __m256, f32) {
    let kind = Kind32::ALL[K];
    let blk = row.data.as_ptr().add(b * kind.bytes());
    match kind {
        Kind32::Q8_0 => (
            _mm256_loadu_si256(blk.add(2) as *const __m256i),
            half8_at(blk),
            0.0,
        ),
        Kind32::Int8 => (
            _mm256_loadu_si256(blk as *const __m256i),
            _mm256_set1_ps(row.scale),
            0.0,
        ),
        Kind32::Q4_0 => (nibbles(blk.add(2)), half8_at(blk), 0.0),
        Kind32::Q4 => (
            nibbles(blk),
            _mm256_broadcast_ss(row.scales.get_unchecked(b)),
            0.0,
        ),
        Kind32::Q4_1 => (nibbles(blk.add(4)), half8_at(blk), half_at(blk.add(2))),
        Kind32::Q5_0 => (
            _mm256_or_si256(nibbles(blk.add(6)), fifth_bits::<VNNI>(blk.add(2))),
            half8_at(blk),
            0.0,
        ),
        Kind32::Q5_1 => (
            _mm256_or_si256(nibbles(blk.add(8)), fifth_bits::<VNNI>(blk.add(4))),
            half8_at(blk),
            half_at(blk.add(2)),
        ),
    }
}

/// [`levels32`] with the offset taken off: signed levels, or unsigned ones
/// for the affine kinds.
#[inline(always)]
unsafe fn block32<const K: usize>(row: &Row, b: usize) -> (__m256i, __m256, f32) {
    let (u, d, m) = levels32::<K, false>(row, b);
    match level_offset(Kind32::ALL[K]) {
        0 => (u, d, m),
        o => (_mm256_sub_epi8(u, _mm256_set1_epi8(o)), d, m),
    }
}

/// The 32 bits at `p` (little-endian) as 32 bytes: 16 where value i's bit
/// is set, else 0. With AVX-512 the bits are the byte mask of one masked move.
#[inline(always)]
unsafe fn fifth_bits<const VNNI: bool>(p: *const u8) -> __m256i {
    let bits = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
    if VNNI {
        return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16));
    }
    // Byte i of the register gets byte i / 8 of the bits (within each lane).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// `out[k] = Σ w · x` of one weight row of 32-value blocks with the
/// activation rows `ts` (at most [`GROUP`]). Each row's sum is accumulated
/// as [`decode32`] accumulates a single row's, bit for bit, so a row's
/// result does not depend on the rows beside it in the step: a sequence
/// decodes alike alone and batched, and a verified draft is the token a
/// one-token step samples. (Gathering four rows' sums into one register
/// before scaling saved conversions but rounded differently, and changed
/// greedy output with drafts on an AVX2-only machine.)
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dots32(
    kind: Kind32,
    row: &Row,
    acts: &QuantizedActs,
    ts: Range<usize>,
    out: &mut [f32],
) {
    with_kind32!(kind, K => match ts.len() {
        1 => dots32_t::<1, K>(row, acts, ts.start, out),
        2 => dots32_t::<2, K>(row, acts, ts.start, out),
        3 => dots32_t::<3, K>(row, acts, ts.start, out),
        _ => dots32_t::<4, K>(row, acts, ts.start, out),
    })
}

/// [`dots32`] for `T` activation rows from `t0` and the kind `Kind32::ALL[K]`.
#[inline(always)]
unsafe fn dots32_t<const T: usize, const K: usize>(
    row: &Row,
    acts: &QuantizedActs,
    t0: usize,
    out: &mut [f32],
) {
    const { assert!(T <= GROUP) };
    let kind = Kind32::ALL[K];
    let blocks = acts.cols / 32;
    let qs: [*const i8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr());
    let scales: [*const f32; T] =
        std::array::from_fn(|k| acts.scales[(t0 + k) * blocks..].as_ptr());
    let mut offsets = [0f32; T];
    let ahead = row.data.as_ptr().wrapping_add(PREFETCH_BYTES);
    // A macro, not a closure: a closure does not inherit the function's
    // target features, and its intrinsics were calls.
    macro_rules! step {
        ($b:expr, $acc:expr) => {{
            let (b, acc): (usize, &mut [__m256; T]) = ($b, $acc);
            // The rows after this one, read next, on their way into the cache.
            crate::prefetch(ahead.wrapping_add(b * kind.bytes()), 1);
            let (w, d, m) = block32::<K>(row, b);
            // The weight's sign moves onto the activations once per block.
            let w_abs = _mm256_sign_epi8(w, w);
            for k in 0..T {
                let a = _mm256_loadu_si256(qs[k].add(32 * b) as *const __m256i);
                let s = if kind.affine() {
                    dot_u8(w, a)
                } else {
                    dot_u8(w_abs, _mm256_sign_epi8(a, w))
                };
                let da = *scales[k].add(b);
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(da));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[k]);
                if kind.affine() {
                    let qsum = acts.sum16(t0 + k, 2 * b) + acts.sum16(t0 + k, 2 * b + 1);
                    offsets[k] += da * m * qsum as f32;
                }
            }
        }};
    }
    // Even and odd blocks in their own registers (see `even_odd!`).
    let (mut even, mut odd) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    even_odd!(blocks, step, &mut even, &mut odd);
    for k in 0..T {
        out[k] = hsum_ps(_mm256_add_ps(even[k], odd[k])) + offsets[k];
    }
}

avx2_and_vnni! {
    /// `out[i] = Σ_c acts[0, c] · W[rows.start + i, c]` for one activation row
    /// (decode; `acts` has one row), weight rows two at a time, one from each
    /// half of the range. Two far-apart sequential streams keep the hardware
    /// prefetchers busy; two neighbouring rows read alternately (680 bytes
    /// apart on the demo's head) ran at two thirds of one stream's rate on a
    /// 2-core AMD EPYC. (Four far streams read faster alone, but decoded
    /// slower in the model. With VNNI, Q5_0/Q5_1's fifth bits are set by one
    /// masked move; one row at a time, two blocks per 512-bit register, had
    /// run Q8_0 and Q5_0 25–30% slower: one stream.)
    pub unsafe fn decode32 / decode32_vnni<'a>(
        kind: Kind32,
        rows: Range<usize>,
        row_of: &dyn Fn(usize) -> Row<'a>,
        acts: &QuantizedActs,
        out: &mut [f32],
    ) => decode32_kind
}

#[inline(always)]
unsafe fn decode32_kind<'a, const VNNI: bool>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    with_kind32!(kind, K => decode32_t::<K, VNNI>(rows, row_of, acts, out))
}

/// [`decode32`] for the kind `Kind32::ALL[K]`: the pair loop and the
/// kernel in one function (one call per range, not one per pair).
#[inline(always)]
unsafe fn decode32_t<'a, const K: usize, const VNNI: bool>(
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let (start, len) = (rows.start, rows.len());
    let half = len.div_ceil(2);
    for i in 0..half {
        let j = i + half;
        let a = row_of(start + i);
        let b = if j < len { row_of(start + j) } else { a };
        let [ya, yb] = two_rows_t::<K, VNNI>([&a, &b], acts);
        out[i] = ya;
        if j < len {
            out[j] = yb;
        }
    }
}

/// Two weight rows against the one activation row: the activation block
/// and its scale are loaded once for both rows.
#[inline(always)]
unsafe fn two_rows_t<const K: usize, const VNNI: bool>(
    rows: [&Row; 2],
    acts: &QuantizedActs,
) -> [f32; 2] {
    let kind = Kind32::ALL[K];
    let blocks = acts.cols / 32;
    let (qs, scales) = (acts.row(0).as_ptr(), acts.scales.as_ptr());
    let mut offsets = [0f32; 2];
    // No software prefetch: the two rows are far apart, sequential streams
    // that the hardware prefetchers follow (a hint 1 KiB ahead measured
    // slower).
    let offset = level_offset(kind);
    macro_rules! step {
        ($b:expr, $acc:expr) => {{
            let (b, acc): (usize, &mut [__m256; 2]) = ($b, $acc);
            let a = _mm256_loadu_si256(qs.add(32 * b) as *const __m256i);
            let da = *scales.add(b);
            let da8 = _mm256_set1_ps(da);
            // With an offset `o`, Σ (u − o)·a = Σ u·a − Σ o·a: the unsigned
            // levels go into `vpmaddubsw` as they are (no sign moves), and the
            // pairs of o·a, shared by both rows, are taken off before widening
            // (|u·a pairs| ≤ 31·127·2 and |o·a pairs| ≤ 16·127·2 stay in i16).
            // With VNNI the offset's sums are taken off in 32 bits, after
            // one `vpdpbusd` per row.
            let shift = if VNNI {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(offset), a)
            } else {
                _mm256_maddubs_epi16(_mm256_set1_epi8(offset), a)
            };
            for i in 0..2 {
                let (w, d, m) = levels32::<K, VNNI>(rows[i], b);
                let s = if VNNI {
                    let zero = _mm256_setzero_si256();
                    if kind.affine() {
                        _mm256_dpbusd_epi32(zero, w, a)
                    } else if offset != 0 {
                        _mm256_sub_epi32(_mm256_dpbusd_epi32(zero, w, a), shift)
                    } else {
                        _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(w), _mm256_sign_epi8(a, w))
                    }
                } else if kind.affine() {
                    dot_u8(w, a)
                } else if offset != 0 {
                    _mm256_madd_epi16(
                        _mm256_sub_epi16(_mm256_maddubs_epi16(w, a), shift),
                        _mm256_set1_epi16(1),
                    )
                } else {
                    dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
                };
                let scale = _mm256_mul_ps(d, da8);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[i]);
                if kind.affine() {
                    let qsum = acts.sum16(0, 2 * b) + acts.sum16(0, 2 * b + 1);
                    offsets[i] += da * m * qsum as f32;
                }
            }
        }};
    }
    // Even and odd blocks in their own registers (see `even_odd!`): four
    // chains of FMAs, not two, so that a row's blocks do not wait on each
    // other's latency.
    let (mut even, mut odd) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
    even_odd!(blocks, step, &mut even, &mut odd);
    [
        hsum_ps(_mm256_add_ps(even[0], odd[0])) + offsets[0],
        hsum_ps(_mm256_add_ps(even[1], odd[1])) + offsets[1],
    ]
}

/// `out[t · rows.len() + i] = Σ_c acts[t, c] · W[rows.start + i, c]` for
/// two to [`crate::GEMM_MIN_ROWS`] − 1 activation rows (batched decode) with
/// AVX-512 VNNI: weight rows two at a time, one from each half of the range
/// (as [`decode32`]), each against [`GROUP`] activation rows at once. Per
/// block and weight row, each activation row costs one `vpdpbusd`; the four
/// rows' sums are gathered into one register by horizontal adds, so the
/// conversion, the scaling and the accumulation run once per block and
/// weight row, not once per activation row too. Signed levels (Q8_0, int8)
/// meet the activations lifted by 128 into unsigned bytes, the sum starting
/// from −128 · Σw (one `vpdpbusd` per block, shared by the activation rows)
/// instead of moving each weight's sign onto every activation row.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn few_rows32_vnni<'a>(
    kind: Kind32,
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    with_kind32!(kind, K => few_rows32_t::<K>(rows, row_of, acts, out))
}

/// Row `row`'s levels as the integer GEMM stages them, `v + 128` for
/// each value `v` of [`crate::intdot::decode32`] (all lie in −128..=127),
/// into `out` (`cols` bytes), and each block's `(d, m)` into `dm`: the
/// same numbers as `decode32`, 32 at a time in registers instead of one by
/// one through 16-bit values.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C;
/// `row` holds `out.len() / 32` blocks of `kind` and `dm` that many pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn stage32_vnni(kind: Kind32, row: &Row, out: &mut [u8], dm: &mut [(f32, f32)]) {
    with_kind32!(kind, K => stage32_t::<K>(row, out, dm))
}

#[inline(always)]
unsafe fn stage32_t<const K: usize>(row: &Row, out: &mut [u8], dm: &mut [(f32, f32)]) {
    // `v = level − offset` (signed levels: offset 0), so `v + 128` is the
    // level plus `128 − offset` in wrapping byte arithmetic.
    let lift = _mm256_set1_epi8(128u8.wrapping_sub(level_offset(Kind32::ALL[K]) as u8) as i8);
    for (b, (dst, dm)) in out.chunks_exact_mut(32).zip(dm.iter_mut()).enumerate() {
        let (u, d, m) = levels32::<K, true>(row, b);
        _mm256_storeu_si256(dst.as_mut_ptr().cast(), _mm256_add_epi8(u, lift));
        *dm = (_mm256_cvtss_f32(d), m);
    }
}

/// Whether `kind` stores signed levels (no offset, not affine).
const fn signed_levels(kind: Kind32) -> bool {
    level_offset(kind) == 0 && !kind.affine()
}

/// [`few_rows32_vnni`] for the kind `Kind32::ALL[K]`.
#[inline(always)]
unsafe fn few_rows32_t<'a, const K: usize>(
    rows: Range<usize>,
    row_of: &dyn Fn(usize) -> Row<'a>,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let kind = Kind32::ALL[K];
    let (start, len, n, cols) = (rows.start, rows.len(), acts.n, acts.cols);
    // The activations as the kernel reads them: lifted by 128 into unsigned
    // bytes for signed levels, as they are otherwise.
    let lifted: Vec<u8> = if signed_levels(kind) {
        acts.qs[..n * cols]
            .iter()
            .map(|&q| (q as u8) ^ 0x80)
            .collect()
    } else {
        Vec::new()
    };
    let qs = if signed_levels(kind) {
        lifted.as_ptr()
    } else {
        acts.qs.as_ptr().cast::<u8>()
    };
    let half = len.div_ceil(2);
    for i in 0..half {
        let j = i + half;
        let a = row_of(start + i);
        let b = if j < len { row_of(start + j) } else { a };
        for t0 in (0..n).step_by(GROUP) {
            // Two activation rows left (or one) take the kernel for two.
            let [ya, yb] = if n - t0 > 2 {
                two_rows_four_t::<K, 4>([&a, &b], acts, qs, t0)
            } else {
                two_rows_four_t::<K, 2>([&a, &b], acts, qs, t0)
            };
            for (k, t) in (t0..n.min(t0 + GROUP)).enumerate() {
                out[t * len + i] = ya[k];
                if j < len {
                    out[t * len + j] = yb[k];
                }
            }
        }
    }
}

/// Two weight rows against the activation rows `t0..t0 + T` (`T` is 2 or
/// [`GROUP`]; rows past the last repeat it, and their sums are dropped),
/// whose bytes are at `qs` (`[acts.n, acts.cols]`, as [`few_rows32_t`]
/// prepares them). Lane `k` and `k + 4` of a row's accumulators belong to
/// activation row `t0 + k` (zero for `k ≥ T`).
#[inline(always)]
unsafe fn two_rows_four_t<const K: usize, const T: usize>(
    rows: [&Row; 2],
    acts: &QuantizedActs,
    qs: *const u8,
    t0: usize,
) -> [[f32; GROUP]; 2] {
    const { assert!(GROUP == 4 && (T == 2 || T == GROUP)) };
    let kind = Kind32::ALL[K];
    let (cols, blocks) = (acts.cols, acts.cols / 32);
    let last = acts.n - 1;
    let qs: [*const u8; 4] = std::array::from_fn(|k| qs.add((t0 + k).min(last) * cols));
    // Block b's four activation scales, at 4 · b (zero past the last row).
    let group = acts.group_scales.as_ptr().add(t0 / 4 * blocks * 4);
    let offset = level_offset(kind);
    let zero = _mm256_setzero_si256();
    // The affine kinds' minimum meets each activation row's block sum.
    let mut mins = [_mm_setzero_ps(); 2];
    macro_rules! step {
        ($b:expr, $acc:expr) => {{
            let (b, acc): (usize, &mut [__m256; 2]) = ($b, $acc);
            let da = _mm256_broadcast_ps(&*(group.add(4 * b) as *const __m128));
            let a: [__m256i; 4] = std::array::from_fn(|k| {
                if k < T {
                    _mm256_loadu_si256(qs[k].add(32 * b) as *const __m256i)
                } else {
                    zero
                }
            });
            // With an offset `o`: Σ (u − o)·a starts from −o · Σa, shared by
            // both weight rows.
            let start: [__m256i; 4] = std::array::from_fn(|k| {
                if offset != 0 && k < T {
                    _mm256_sub_epi32(
                        zero,
                        _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(offset), a[k]),
                    )
                } else {
                    zero
                }
            });
            let block_sums = if kind.affine() {
                let t = |k: usize| (t0 + k).min(last);
                let q = |k: usize| (acts.sum16(t(k), 2 * b) + acts.sum16(t(k), 2 * b + 1)) as f32;
                _mm_mul_ps(
                    _mm_setr_ps(q(0), q(1), q(2), q(3)),
                    _mm256_castps256_ps128(da),
                )
            } else {
                _mm_setzero_ps()
            };
            for i in 0..2 {
                let (w, d, m) = levels32::<K, true>(rows[i], b);
                let s: [__m256i; 4] = if signed_levels(kind) {
                    // Σ (a + 128)·w − 128 · Σw.
                    let lift = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(-128), w);
                    let from = _mm256_sub_epi32(zero, lift);
                    std::array::from_fn(|k| {
                        if k < T {
                            _mm256_dpbusd_epi32(from, a[k], w)
                        } else {
                            zero
                        }
                    })
                } else {
                    std::array::from_fn(|k| {
                        if k < T {
                            _mm256_dpbusd_epi32(start[k], w, a[k])
                        } else {
                            zero
                        }
                    })
                };
                let sums =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, da), acc[i]);
                if kind.affine() {
                    mins[i] = _mm_fmadd_ps(_mm_set1_ps(m), block_sums, mins[i]);
                }
            }
        }};
    }
    // Even and odd blocks in their own registers (see `even_odd!`).
    let (mut even, mut odd) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
    even_odd!(blocks, step, &mut even, &mut odd);
    std::array::from_fn(|i| {
        let both = _mm256_add_ps(even[i], odd[i]);
        let four = _mm_add_ps(
            _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1)),
            mins[i],
        );
        let mut y = [0f32; 4];
        _mm_storeu_ps(y.as_mut_ptr(), four);
        y
    })
}

/// A k-quant super-block's scales as the AVX2 kernel applies them.
struct KScales {
    /// The 16-bit factors of level register `c` (values 32c..32c + 32): the
    /// scale of values 32c..32c + 16 in the low lane, of the next 16 in the
    /// high lane.
    scales: [__m256i; 8],
    /// Per 16-value group, in two registers (lane l: group l, then group
    /// l + 8), the factor of the group's activation sum as a 32-bit lane
    /// with a zero upper half: the min (Q4_K/Q5_K) or the scale (Q6_K).
    groups: [__m256i; 2],
    d: f32,
    dmin: f32,
}

/// The scales of super-block `blk`, decoded in registers: the same integers
/// as [`crate::intdot::scales_k`] gives, without a byte array in between.
#[inline(always)]
unsafe fn scales_k_avx2(kind: KindK, blk: &[u8]) -> KScales {
    let p = blk.as_ptr();
    // A `vpshufb` mask: 16-bit word `lo` of the low lane repeated through
    // the low lane, word `hi` of the high lane through the high lane.
    let pick = |lo: i32, hi: i32| {
        let word = |w: i32| (2 * w) | ((2 * w + 1) << 8);
        let (lo, hi) = (word(lo) * 0x0001_0001, word(hi) * 0x0001_0001);
        _mm256_set_epi32(hi, hi, hi, hi, lo, lo, lo, lo)
    };
    let low16 = _mm256_set1_epi32(0xFFFF);
    match kind {
        KindK::Q4K | KindK::Q5K => {
            // Twelve bytes: scales 0–3 and mins 0–3 in the low six bits of
            // bytes 0–7; scales 4–7 and mins 4–7 as the nibbles of bytes
            // 8–11 with their top two bits in the top bits of bytes 0–7.
            // Unpacked in a vector register (the bytes after the twelve are
            // the levels', read and masked off): `v` = scales 0–7, mins 0–7.
            // Decoded with scalar shifts, the scales had kept each
            // super-block's products waiting on the moves into vectors.
            let x = _mm_loadu_si128(p.add(4) as *const __m128i);
            let a = _mm_shuffle_epi8(
                x,
                _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
            );
            let b = _mm_shuffle_epi8(
                x,
                _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
            );
            let six_four = _mm_setr_epi8(
                0x3F, 0x3F, 0x3F, 0x3F, 0x0F, 0x0F, 0x0F, 0x0F, 0x3F, 0x3F, 0x3F, 0x3F, 0, 0, 0, 0,
            );
            let high_nibbles = _mm_and_si128(
                _mm_srli_epi16(a, 4),
                _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0F, 0x0F, 0x0F, 0x0F),
            );
            let top_bits = _mm_and_si128(
                _mm_srli_epi16(b, 2),
                _mm_setr_epi8(
                    0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30,
                ),
            );
            let v = _mm_or_si128(
                _mm_or_si128(_mm_and_si128(a, six_four), high_nibbles),
                top_bits,
            );
            let sc16 = _mm_cvtepu8_epi16(v);
            let both = _mm256_broadcastsi128_si256(sc16);
            // One scale per 32 values: both lanes of register c take scale c.
            let mut scales = [_mm256_setzero_si256(); 8];
            for (c, r) in scales.iter_mut().enumerate() {
                *r = _mm256_shuffle_epi8(both, pick(c as i32, c as i32));
            }
            // Groups 2j and 2j + 1 share min j.
            let pairs = _mm_shuffle_epi8(
                v,
                _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
            );
            let groups = [
                _mm256_cvtepu8_epi32(pairs),
                _mm256_cvtepu8_epi32(_mm_srli_si128(pairs, 8)),
            ];
            KScales {
                scales,
                groups,
                d: half_at(p),
                dmin: half_at(p.add(2)),
            }
        }
        KindK::Q6K => {
            // Sixteen signed scales, one per 16 values.
            let raw = _mm_loadu_si128(p.add(192) as *const __m128i);
            let sc16 = _mm256_cvtepi8_epi16(raw);
            let (lo, hi) = (
                _mm256_permute2x128_si256(sc16, sc16, 0x00),
                _mm256_permute2x128_si256(sc16, sc16, 0x11),
            );
            let mut scales = [_mm256_setzero_si256(); 8];
            for (c, v) in scales.iter_mut().enumerate() {
                let j = (c % 4) as i32;
                *v = _mm256_shuffle_epi8(if c < 4 { lo } else { hi }, pick(2 * j, 2 * j + 1));
            }
            let groups = [
                _mm256_and_si256(_mm256_cvtepi8_epi32(raw), low16),
                _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)), low16),
            ];
            KScales {
                scales,
                groups,
                d: half_at(p.add(208)),
                dmin: 0.0,
            }
        }
    }
}

/// The 256 levels of a k-quant super-block as eight registers of 32
/// unsigned bytes, in value order (as [`crate::intdot::decode_k`] lays them).
#[inline(always)]
unsafe fn levels_k(kind: KindK, blk: &[u8]) -> [__m256i; 8] {
    let load = |at: usize| _mm256_loadu_si256(blk.as_ptr().add(at) as *const __m256i);
    let low = _mm256_set1_epi8(0x0F);
    let lo = |q: __m256i| _mm256_and_si256(q, low);
    let hi = |q: __m256i| _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    // Bits `shift` and `shift + 1` of each byte, moved to bits 4 and 5.
    let two_bits = |q: __m256i, shift: i32| {
        let b = _mm256_and_si256(
            _mm256_srl_epi16(q, _mm_cvtsi32_si128(shift)),
            _mm256_set1_epi8(3),
        );
        _mm256_slli_epi16(b, 4)
    };
    // Bit `shift` of each byte, moved to bit 4.
    let one_bit = |q: __m256i, shift: i32| {
        let b = _mm256_and_si256(
            _mm256_srl_epi16(q, _mm_cvtsi32_si128(shift)),
            _mm256_set1_epi8(1),
        );
        _mm256_slli_epi16(b, 4)
    };
    let mut u = [_mm256_setzero_si256(); 8];
    match kind {
        KindK::Q4K => {
            for j in 0..4 {
                let q = load(16 + 32 * j);
                u[2 * j] = lo(q);
                u[2 * j + 1] = hi(q);
            }
        }
        KindK::Q5K => {
            let qh = load(16);
            for j in 0..4 {
                let q = load(48 + 32 * j);
                u[2 * j] = _mm256_or_si256(lo(q), one_bit(qh, 2 * j as i32));
                u[2 * j + 1] = _mm256_or_si256(hi(q), one_bit(qh, 2 * j as i32 + 1));
            }
        }
        KindK::Q6K => {
            for n in 0..2 {
                let (ql0, ql1, qh) = (load(64 * n), load(64 * n + 32), load(128 + 32 * n));
                u[4 * n] = _mm256_or_si256(lo(ql0), two_bits(qh, 0));
                u[4 * n + 1] = _mm256_or_si256(lo(ql1), two_bits(qh, 2));
                u[4 * n + 2] = _mm256_or_si256(hi(ql0), two_bits(qh, 4));
                u[4 * n + 3] = _mm256_or_si256(hi(ql1), two_bits(qh, 6));
            }
        }
    }
    u
}

avx2_and_vnni! {
    /// `out[t · rows.len() + i] = Σ_c acts[t, c] · W[rows.start + i, c]` for
    /// the weight rows `rows` of `data` (k-quant super-blocks stored row
    /// after row) and every activation row of `acts`, [`GROUP`] activation
    /// rows at a time. The loops over rows run here, not one call per row: a
    /// decode step's rows are a few super-blocks long (six at width 1536),
    /// and the call, the group bookkeeping and the final horizontal sum of
    /// each had cost as much as a super-block.
    pub unsafe fn rows_k / rows_k_vnni(
        kind: KindK,
        rows: Range<usize>,
        data: &[u8],
        acts: &QuantizedActs,
        out: &mut [f32],
    ) => rows_k_t
}

#[inline(always)]
unsafe fn rows_k_t<const VNNI: bool>(
    kind: KindK,
    rows: Range<usize>,
    data: &[u8],
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let w = acts.cols / 256 * k_bytes(kind);
    let (n, len) = (acts.n, rows.len());
    macro_rules! each_row {
        ($k:literal) => {{
            // One activation row (decode) writes each sum in place: through
            // the group buffer below, Q4_K/Q6_K at 6144x1536 ran 15% slower.
            if n == 1 {
                for (o, r) in out.iter_mut().zip(rows) {
                    let row = &data[r * w..(r + 1) * w];
                    dots_k_t::<1, $k, VNNI>(row, acts, 0, std::slice::from_mut(o));
                }
                return;
            }
            for (i, r) in rows.enumerate() {
                let row = &data[r * w..(r + 1) * w];
                for t0 in (0..n).step_by(GROUP) {
                    let mut part = [0f32; GROUP];
                    let group = (n - t0).min(GROUP);
                    match group {
                        1 => dots_k_t::<1, $k, VNNI>(row, acts, t0, &mut part),
                        2 => dots_k_t::<2, $k, VNNI>(row, acts, t0, &mut part),
                        3 => dots_k_t::<3, $k, VNNI>(row, acts, t0, &mut part),
                        _ => dots_k_t::<4, $k, VNNI>(row, acts, t0, &mut part),
                    }
                    for (k, &y) in part[..group].iter().enumerate() {
                        out[(t0 + k) * len + i] = y;
                    }
                }
            }
        }};
    }
    match kind {
        KindK::Q4K => each_row!(0),
        KindK::Q5K => each_row!(1),
        KindK::Q6K => each_row!(2),
    }
}

/// `out[k] = Σ w · x` of one row of k-quant super-blocks with the `T`
/// activation rows from `t0`, for the kind
/// `KindK::ALL[K]`: the accumulators stay in registers, and each level
/// register meets the rows' activations as soon as it is decoded. `VNNI`:
/// the caller has AVX-512 VNNI (inlined into a function that enables it).
#[inline(always)]
unsafe fn dots_k_t<const T: usize, const K: usize, const VNNI: bool>(
    row: &[u8],
    acts: &QuantizedActs,
    t0: usize,
    out: &mut [f32],
) {
    const { assert!(T <= GROUP) };
    let kind = KindK::ALL[K];
    let bytes = k_bytes(kind);
    let supers = acts.cols / 256;
    let qs: [*const i8; T] = std::array::from_fn(|k| acts.row(t0 + k).as_ptr());
    let scales: [*const f32; T] =
        std::array::from_fn(|k| acts.scales[(t0 + k) * supers..].as_ptr());
    let sums: [*const i32; T] =
        std::array::from_fn(|k| acts.sums[(t0 + k) * (acts.cols / 16)..].as_ptr());
    let mut acc = [_mm256_setzero_ps(); T];
    for (s, blk) in row.chunks_exact(bytes).enumerate() {
        let KScales {
            scales: factors,
            groups,
            d,
            dmin,
        } = scales_k_avx2(kind, blk);
        let u = levels_k(kind, blk);
        // Even and odd level registers sum into their own registers: two
        // chains of `vpdpwssd` (latency 4–5 cycles each), not one.
        let mut dot = [[_mm256_setzero_si256(); T]; 2];
        for c in 0..8 {
            for k in 0..T {
                let av = _mm256_loadu_si256(qs[k].add(256 * s + 32 * c) as *const __m256i);
                let p = _mm256_maddubs_epi16(u[c], av);
                let d = &mut dot[c % 2][k];
                *d = if VNNI {
                    _mm256_dpwssd_epi32(*d, p, factors[c])
                } else {
                    _mm256_add_epi32(*d, _mm256_madd_epi16(p, factors[c]))
                };
            }
        }
        for k in 0..T {
            // The 16 groups' activation sums (lane l: groups l and l + 8),
            // against the mins (Q4_K/Q5_K) or the scales times Q6_K's
            // offset of 32. The sums fit in 16 bits (|Σ| ≤ 16 · 127) and
            // the factors have zero upper halves, so `vpmaddwd` multiplies
            // each lane exactly.
            let g = sums[k].add(16 * s);
            let (g0, g1) = (
                _mm256_loadu_si256(g as *const __m256i),
                _mm256_loadu_si256(g.add(8) as *const __m256i),
            );
            let by_group = _mm256_add_epi32(
                _mm256_madd_epi16(g0, groups[0]),
                _mm256_madd_epi16(g1, groups[1]),
            );
            let mut sum = _mm256_add_epi32(dot[0][k], dot[1][k]);
            if kind == KindK::Q6K {
                sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(by_group, 5));
            }
            let da = *scales[k].add(s);
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(da * d), acc[k]);
            if kind != KindK::Q6K {
                acc[k] = _mm256_fnmadd_ps(
                    _mm256_cvtepi32_ps(by_group),
                    _mm256_set1_ps(da * dmin),
                    acc[k],
                );
            }
        }
    }
    for k in 0..T {
        out[k] = hsum_ps(acc[k]);
    }
}
