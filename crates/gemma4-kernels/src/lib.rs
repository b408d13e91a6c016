//! CPU kernels over weight matrices kept in their stored form.
//!
//! A [`WeightMatrix`] is a row-major `[rows, cols]` matrix in some storage
//! (bf16 bytes of a memory-mapped checkpoint, GGUF blocks, our int8 or 4-bit
//! layouts). Each storage type knows two things: how to widen a range of rows
//! to f32, and (where it has a fused kernel) how to take dot products of its
//! rows with f32 activations directly. [`matmul`] builds `y = x · Wᵀ` from
//! those: fused dot products for a few activation rows (decode), dequantized
//! tiles multiplied with the `gemm` crate for many (prefill). Every product
//! accumulates in f32 and keeps activations in f32, so results match the
//! widened f32 product up to summation order.
//!
//! Quantized storage types also have an integer kernel ([`IntegerDots`],
//! module [`intdot`]): with [`Precision::Int8Activations`] the activations
//! are rounded to 8 bits per block once per product and meet the weights'
//! integer levels in 8-bit multiplies, as llama.cpp computes; faster, and
//! not exact. On a CPU with AVX-512 VNNI, products of
//! [`INTGEMM_MIN_ROWS`] activation rows or more run on 16-row panels
//! (module `intgemm`), and the layouts rearranged at load ([`kquant_x8`],
//! [`block32_x8`]) run their own kernels for any number of rows.
//!
//! Embedding tables use the same interface: a lookup widens only the rows
//! of the step's tokens.

pub mod acts;
pub mod arena;
pub mod bandwidth;
pub mod block32_x8;
mod bytes;
mod dispatch;
pub mod float;
pub mod gelu;
pub mod int8;
pub mod intdot;
#[cfg(target_arch = "x86_64")]
mod intdot_avx2;
#[cfg(target_arch = "aarch64")]
mod intdot_neon;
#[cfg(target_arch = "x86_64")]
mod intgemm;
pub mod kquant;
pub mod kquant_x8;
pub mod legacy;
pub mod norm;
mod order;
pub mod panel;
pub mod pool;
pub mod q4;
pub mod q8_0;
pub mod softcap;

pub use acts::{ActBlock, QuantizedActs};
pub use bytes::Bytes;
pub use dispatch::{level, Level};

use std::mem::MaybeUninit;
use std::ops::Range;

/// A row-major `[rows, cols]` weight matrix in some storage.
pub trait WeightMatrix: Send + Sync + std::fmt::Debug {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Short name of the storage (`bf16`, `int8`, `q4`, `Q6K`, …).
    fn storage(&self) -> &'static str;
    /// Bytes this matrix keeps in memory (or maps), for planning and reports.
    fn stored_bytes(&self) -> usize;
    /// The bytes a product reads, in the order its row chunks read them,
    /// where they are one run in memory (for the pool's read-ahead).
    fn stored_run(&self) -> Option<&[u8]> {
        None
    }
    /// Rows `rows` widened to f32, row-major, into `out` (`rows.len() · cols` values).
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]);
    /// `out[t · rows.len() + (r − rows.start)] = Σ_c x[t · cols + c] · W[r, c]`
    /// for `n` activation rows. The default widens each row, then takes f32
    /// dot products; storage types with a fused kernel override it.
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let cols = self.cols();
        let len = rows.len();
        let mut row = vec![0f32; cols];
        for (i, r) in rows.enumerate() {
            self.dequantize_rows(r..r + 1, &mut row);
            for t in 0..n {
                out[t * len + i] = float::dot_f32(&x[t * cols..(t + 1) * cols], &row);
            }
        }
    }
    /// The integer kernel of this storage, if it has one.
    fn integer(&self) -> Option<&dyn IntegerDots> {
        None
    }
}

/// Dot products of a storage type's rows with activations rounded to 8
/// bits per block.
pub trait IntegerDots: Sync {
    /// The block length the activations are rounded in.
    fn act_block(&self) -> ActBlock;
    /// `out[t · rows.len() + (r − rows.start)] = Σ_c acts[t, c] · W[r, c]`
    /// for every activation row `t` of `acts`.
    fn int_dots(&self, rows: Range<usize>, acts: &QuantizedActs, out: &mut [f32]);
}

/// A matrix rearranged at load from GGUF's row-major blocks (rows
/// interleaved for a kernel), built a slice of whole row groups at a time so
/// the loader can drop each slice of the file's pages once it is copied.
pub trait Rearranged: WeightMatrix + Sized {
    /// Storage name in reports.
    const NAME: &'static str;
    /// Rows rearranged together: a slice holds whole groups of them.
    const GROUP_ROWS: usize;
    /// An empty matrix of `cols` columns with room for `rows` rows; `None`
    /// when `cols` does not tile into the format's blocks or `rows` into groups.
    fn with_capacity(rows: usize, cols: usize) -> Option<Self>;
    /// Bytes a `[rows, cols]` matrix takes in this layout.
    fn bytes_for(rows: usize, cols: usize) -> usize;
    /// Rearranges whole rows given in GGUF's bytes onto the end; false (and
    /// nothing added) when they are not whole groups or more than the room left.
    fn append_gguf(&mut self, data: &[u8]) -> bool;
    /// The whole matrix from GGUF's bytes; `None` when the sizes disagree.
    fn from_gguf(data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let mut m = Self::with_capacity(rows, cols)?;
        (m.append_gguf(data) && m.rows() == rows).then_some(m)
    }
}

/// How far ahead of the block being read the interleaved kernels prefetch
/// their weights. On the Intel machine the hardware prefetchers alone kept
/// one thread's read of a large Q4_Kx8 matrix at 0.78 of a plain read; with
/// this, 0.93–1.00 (`--bench decode_chain`; 1, 1.5 and 3 KiB did less).
const PREFETCH_AHEAD: usize = 2048;

/// Asks for the cache lines of the `bytes` from `p` to be brought into the
/// caches, one request per line: a hint that reads nothing, so an address
/// past the end of the data (or of any mapping) does no harm. Every
/// weight stream and the in-place attention use this one helper.
#[inline(always)]
pub fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        // SAFETY: SSE is part of x86_64, and a prefetch does not fault.
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                p.wrapping_add(line).cast::<i8>(),
                std::arch::x86_64::_MM_HINT_T0,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// [`prefetch`] of the `bytes` that lie [`PREFETCH_AHEAD`] past `p`.
#[inline(always)]
pub(crate) fn prefetch_ahead(p: *const u8, bytes: usize) {
    prefetch(p.wrapping_add(PREFETCH_AHEAD), bytes);
}

/// Runs `kernel(groups, out)`, which computes whole groups of `group`
/// interleaved rows (`[n, 8 · groups.len()]` into `out`), for the rows
/// `rows` (`[n, rows.len()]` into `out`): directly when `rows` covers whole
/// groups, else over every group it touches, keeping the rows asked for.
#[cfg(target_arch = "x86_64")]
pub(crate) fn in_whole_groups(
    rows: Range<usize>,
    group: usize,
    n: usize,
    out: &mut [f32],
    kernel: impl FnOnce(Range<usize>, &mut [f32]),
) {
    let groups = rows.start / group..rows.end.div_ceil(group);
    if rows.start.is_multiple_of(group) && rows.end.is_multiple_of(group) {
        return kernel(groups, out);
    }
    let (len, wide) = (rows.len(), groups.len() * group);
    let skip = rows.start - groups.start * group;
    let mut all = vec![0f32; n * wide];
    kernel(groups, &mut all);
    for t in 0..n {
        out[t * len..(t + 1) * len].copy_from_slice(&all[t * wide + skip..t * wide + skip + len]);
    }
}

/// How a product treats the activations. Without AVX-512 VNNI, products
/// of [`GEMM_MIN_ROWS`] rows or more keep f32 activations either way (see
/// [`matmul_many`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 activations against the stored values (exact up to summation order).
    #[default]
    Exact,
    /// Activations rounded to 8 bits per block for storage types with an
    /// integer kernel (the rest stay exact).
    Int8Activations,
}

/// The instruction sets the kernels run with on this CPU (for reports):
/// the float kernels' level and the integer dot products'.
pub fn describe() -> String {
    let level = dispatch::level();
    // aarch64's float kernels are the portable code, which the compiler
    // vectorizes with NEON at every level.
    let float = if cfg!(target_arch = "aarch64") {
        "neon"
    } else {
        level.name()
    };
    let integer = if intdot::has_vnni() {
        "avx512 vnni"
    } else {
        level.name()
    };
    format!("float {float}, integer {integer}")
}

/// IEEE half → f32, exact, branch-light (inlined into kernels, unlike a
/// library call per block scale).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match exp {
        0 => {
            // Zero or subnormal: mant · 2^-24, exactly representable.
            let v = mant as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

/// From this many activation rows on, [`matmul`] multiplies dequantized
/// tiles with `gemm` instead of taking fused dot products row by row.
pub const GEMM_MIN_ROWS: usize = 8;
/// From this many activation rows on, the VNNI integer products decode
/// each weight panel once and multiply it by every row (`intgemm.rs`);
/// below, the row kernels decode a weight row per group of four activation
/// rows. Decoding a panel costs about as much as multiplying it by eight
/// rows, so batched decode steps of 8–11 sequences ran up to twice as fast
/// on the row kernels (the matmul bench, 2048×2048 and the demo's
/// 262144×640 head, AVX-512 VNNI): the two meet at about 12 rows.
pub const INTGEMM_MIN_ROWS: usize = 12;
/// Weight bytes per chunk that a one-row product aims at (several
/// microseconds of one thread's reading). Each chunk starts the hardware
/// prefetchers over; on huge pages 256 KiB decoded the E2B-shaped Q4_K_M
/// about 5% faster than 64 KiB (interleaved `bench local` rounds).
const DECODE_CHUNK_BYTES: usize = 256 << 10;
/// Weight rows widened at a time on the tiled path.
const TILE_ROWS: usize = 64;

/// `y[t, r] = Σ_c x[t, c] · W[r, c]` for `x` of `n` rows; returns `[n, rows]`.
///
/// Weight rows are split across the thread pool once, so every weight byte
/// is read once per call whatever `n` is.
pub fn matmul(w: &dyn WeightMatrix, x: &[f32], n: usize) -> Vec<f32> {
    matmul_with(w, x, n, Precision::Exact)
}

/// [`matmul`] with the activations treated as `precision` says.
pub fn matmul_with(w: &dyn WeightMatrix, x: &[f32], n: usize, precision: Precision) -> Vec<f32> {
    let mut ys = matmul_many(&[w], x, n, precision);
    ys.pop().unwrap_or_default()
}

/// How one matrix of a [`matmul_many`] call computes its rows.
enum Method<'a> {
    /// The integer kernel, against the activations rounded for it (an
    /// index into the call's rounded activations).
    Integer(&'a dyn IntegerDots, usize),
    /// Widened tiles and `gemm` (many activation rows).
    Tiled,
    /// The storage's fused f32 dot products.
    Dots,
}

/// [`matmul_with`] for several matrices of one width against the same
/// activations (a layer's q/k/v, gate/up): the activations are rounded
/// once per block length, and every matrix's chunks go to the pool as one
/// job, so the threads wait for each other once. Returns `[n, rows]` per
/// matrix, each exactly what [`matmul_with`] gives for it alone.
pub fn matmul_many(
    ws: &[&dyn WeightMatrix],
    x: &[f32],
    n: usize,
    precision: Precision,
) -> Vec<Vec<f32>> {
    let cols = ws.first().map_or(0, |w| w.cols());
    for w in ws {
        assert_eq!(w.cols(), cols, "matrices of one product differ in width");
    }
    assert_eq!(
        x.len(),
        n * cols,
        "activations do not match the weight's width"
    );
    if n == 0 {
        return ws.iter().map(|_| Vec::new()).collect();
    }
    // Many activation rows (prefill) take the integer panels where the CPU
    // has VNNI; elsewhere dequantized tiles and f32 `gemm` are faster than
    // the portable integer kernels there (see the matmul bench).
    let mut rounded: Vec<QuantizedActs> = Vec::new();
    let methods: Vec<Method> = ws
        .iter()
        .map(|w| match (precision, w.integer()) {
            (Precision::Int8Activations, Some(k))
                if (n < GEMM_MIN_ROWS || intdot::has_vnni())
                    && cols.is_multiple_of(k.act_block().values()) =>
            {
                let block = k.act_block();
                let at = match rounded.iter().position(|a| a.block == block) {
                    Some(at) => at,
                    None => {
                        rounded.push(QuantizedActs::quantize(x, n, cols, block));
                        rounded.len() - 1
                    }
                };
                Method::Integer(k, at)
            }
            _ if n >= GEMM_MIN_ROWS => Method::Tiled,
            _ => Method::Dots,
        })
        .collect();
    let pool = pool::global();
    let threads = pool.threads();
    // One thread has no idle worker to read ahead: skip the bookkeeping.
    let followed_by = if threads > 1 { order::starts(ws) } else { None };
    // Every matrix's rows in chunks: (matrix, rows). Several chunks per
    // thread balance uneven progress; on the tiled path a chunk is a whole
    // number of tiles. One activation row (decode) takes one chunk per
    // `DECODE_CHUNK_BYTES` of weights, from one to 16 per thread: the
    // caller's wait for the last chunk had been a tenth of a large model's
    // decode step with four per thread, while a small matrix's claims cost
    // more than its imbalance (E2B-shaped Q4_K_M and the demo decoded about
    // 4% faster with one chunk per thread for the smallest than with four).
    let mut jobs: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let rows = w.rows();
        let granule = if matches!(methods[i], Method::Tiled) {
            TILE_ROWS
        } else {
            16
        };
        let chunks = if n == 1 {
            (w.stored_bytes() / DECODE_CHUNK_BYTES).clamp(threads, threads * 16)
        } else {
            threads * 4
        };
        let chunk = rows.div_ceil(chunks).div_ceil(granule).max(1) * granule;
        jobs.extend(
            (0..rows)
                .step_by(chunk)
                .map(|s| (i, s..(s + chunk).min(rows))),
        );
    }
    // Each chunk writes `[n, range.len()]` into a part of its own: with one
    // activation row, the chunk's rows of the output itself (nothing to
    // copy); with more, a part of one buffer, copied out row by row after.
    let lens: Vec<usize> = jobs.iter().map(|(_, r)| n * r.len()).collect();
    let mut ys: Vec<Vec<f32>> = if n == 1 {
        ws.iter().map(|w| vec![0f32; w.rows()]).collect()
    } else {
        Vec::new()
    };
    let mut scratch = vec![0f32; if n == 1 { 0 } else { lens.iter().sum() }];
    {
        let buffers: Vec<&mut [f32]> = if n == 1 {
            ys.iter_mut().map(|y| y.as_mut_slice()).collect()
        } else {
            vec![scratch.as_mut_slice()]
        };
        let mut buffers = buffers.into_iter();
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(jobs.len());
        let mut rest: &mut [f32] = &mut [];
        for &len in &lens {
            while rest.is_empty() {
                rest = buffers.next().expect("the chunks cover every output");
            }
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(len);
            parts.push(part);
            rest = tail;
        }
        pool.for_each_part(parts, &|j, out| {
            let (i, range) = (jobs[j].0, jobs[j].1.clone());
            match methods[i] {
                Method::Integer(k, at) => k.int_dots(range, &rounded[at], out),
                Method::Tiled => tiled_product(ws[i], range, x, n, out),
                Method::Dots => ws[i].dots(range, x, n, out),
            }
        });
    }
    // The caller's work until the next product leaves the memory bus idle:
    // the workers read that product's first weights meanwhile.
    if let Some(runs) = followed_by {
        pool.read_ahead(runs);
    }
    if n > 1 {
        ys = place_parts(ws, &jobs, &scratch, n, pool);
    }
    ys
}

/// Output values from which [`place_parts`] splits its copying over the
/// threads (a prompt's products; a decode step's few rows stay on the
/// caller).
const PARALLEL_PLACE_VALUES: usize = 1 << 16;

/// The `[n, rows]` outputs of a several-row product, from the parts its
/// chunks wrote into `scratch` (`[n, range.len()]` each, in `jobs` order).
/// The copying writes every output value once, so the outputs are not
/// zeroed first; with many values, bands of activation rows go to the pool.
fn place_parts(
    ws: &[&dyn WeightMatrix],
    jobs: &[(usize, Range<usize>)],
    scratch: &[f32],
    n: usize,
    pool: &pool::Pool,
) -> Vec<Vec<f32>> {
    let mut starts = Vec::with_capacity(jobs.len());
    let mut at = 0;
    for (_, range) in jobs {
        starts.push(at);
        at += n * range.len();
    }
    let values: usize = ws.iter().map(|w| n * w.rows()).sum();
    let bands = if values >= PARALLEL_PLACE_VALUES {
        pool.threads()
    } else {
        1
    };
    let band = n.div_ceil(bands);
    let mut ys: Vec<Vec<MaybeUninit<f32>>> = ws
        .iter()
        .map(|w| {
            let mut y = Vec::with_capacity(n * w.rows());
            // SAFETY: `MaybeUninit` values need no initialization.
            unsafe { y.set_len(n * w.rows()) };
            y
        })
        .collect();
    let mut owners = Vec::new();
    let mut parts: Vec<&mut [MaybeUninit<f32>]> = Vec::new();
    for (i, y) in ys.iter_mut().enumerate() {
        for (b, part) in y.chunks_mut((band * ws[i].rows()).max(1)).enumerate() {
            owners.push((i, b * band));
            parts.push(part);
        }
    }
    let place = |p: usize, out: &mut [MaybeUninit<f32>]| {
        let (i, t0) = owners[p];
        let rows = ws[i].rows();
        for (j, (_, range)) in jobs.iter().enumerate().filter(|(_, (m, _))| *m == i) {
            let len = range.len();
            for (k, y) in out.chunks_exact_mut(rows).enumerate() {
                let from = starts[j] + (t0 + k) * len;
                y[range.clone()].write_copy_of_slice(&scratch[from..from + len]);
            }
        }
    };
    if bands > 1 {
        pool.for_each_part(parts, &place);
    } else {
        for (p, part) in parts.into_iter().enumerate() {
            place(p, part);
        }
    }
    ys.into_iter()
        .map(|y| {
            let mut y = std::mem::ManuallyDrop::new(y);
            // SAFETY: the chunks of each matrix cover its rows `0..rows`
            // without overlap, and the bands cover its activation rows, so
            // `place` wrote every value; `MaybeUninit<f32>` has `f32`'s
            // layout, and the pointer, length and capacity are the vector's own.
            unsafe { Vec::from_raw_parts(y.as_mut_ptr().cast::<f32>(), y.len(), y.capacity()) }
        })
        .collect()
}

/// `out` (`[n, rows.len()]`) for weight rows `rows`, tile by tile: widen
/// `TILE_ROWS` rows, then one `gemm` call per tile.
fn tiled_product(w: &dyn WeightMatrix, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
    let cols = w.cols();
    let len = rows.len();
    let mut tile = vec![0f32; TILE_ROWS.min(len) * cols];
    let mut r = rows.start;
    while r < rows.end {
        let t_rows = TILE_ROWS.min(rows.end - r);
        let tile = &mut tile[..t_rows * cols];
        w.dequantize_rows(r..r + t_rows, tile);
        let col0 = r - rows.start;
        // dst[t, j] = Σ_k x[t, k] · tile[j, k], written into out's columns col0..col0+t_rows.
        // SAFETY: every pointer/stride pair stays inside its slice: x is
        // [n, cols], tile is [t_rows, cols], out is [n, len] with
        // col0 + t_rows ≤ len.
        unsafe {
            gemm::gemm(
                n,
                t_rows,
                cols,
                out.as_mut_ptr().add(col0),
                1,
                len as isize,
                false,
                x.as_ptr(),
                1,
                cols as isize,
                tile.as_ptr(),
                cols as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        r += t_rows;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn many_row_products_place_every_output() {
        // Enough outputs that the placing is split over the pool in bands
        // of activation rows, two matrices of different heights.
        let ws: Vec<crate::float::FloatMatrix> = [(1100, 11), (700, 12)]
            .into_iter()
            .map(|(rows, seed)| {
                let v = crate::testing::values(rows * 64, seed, 0.5);
                crate::float::FloatMatrix::from_f32(&v, rows, 64).expect("shape")
            })
            .collect();
        let n = 72;
        assert!(n * (1100 + 700) >= super::PARALLEL_PLACE_VALUES);
        let x = crate::testing::values(n * 64, 13, 1.0);
        let refs: Vec<&dyn super::WeightMatrix> = ws.iter().map(|w| w as _).collect();
        let ys = super::matmul_many(&refs, &x, n, super::Precision::Exact);
        for (w, y) in refs.iter().zip(&ys) {
            let want = crate::testing::reference(*w, &x, n);
            assert_eq!(y.len(), want.len());
            for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                let tol = 1e-5 * (1.0 + want.abs()) * 8.0;
                assert!(
                    (f64::from(got) - want).abs() <= tol,
                    "element {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn half_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = super::f16_to_f32(h);
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{h:#x}: {got} vs {want}"
            );
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    /// Deterministic values in [-scale, scale).
    pub fn values(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// `v` as little-endian values of `ty`, rounded to nearest.
    pub fn encode_floats(ty: crate::float::FloatType, v: &[f32]) -> Vec<u8> {
        use crate::float::FloatType;
        match ty {
            FloatType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            FloatType::Bf16 => v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
            FloatType::F16 => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }

    /// `blocks` random blocks of `bytes` bytes whose f16 fields (at
    /// `halves` within each block) are sane scales.
    pub fn random_blocks(blocks: usize, bytes: usize, halves: &[usize], seed: u64) -> Vec<u8> {
        let raw = values(blocks * bytes, seed, 1.0);
        let mut out: Vec<u8> = raw.iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
        let scales = values(blocks * halves.len(), seed + 1, 0.05);
        for (b, blk) in out.chunks_exact_mut(bytes).enumerate() {
            for (k, &at) in halves.iter().enumerate() {
                let h = half::f16::from_f32(scales[b * halves.len() + k]).to_le_bytes();
                blk[at..at + 2].copy_from_slice(&h);
            }
        }
        out
    }

    /// The f64 product of `x` `[n, cols]` and the widened rows of `w`.
    pub fn reference(w: &dyn super::WeightMatrix, x: &[f32], n: usize) -> Vec<f64> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut deq = vec![0f32; rows * cols];
        w.dequantize_rows(0..rows, &mut deq);
        let mut y = vec![0f64; n * rows];
        for t in 0..n {
            for r in 0..rows {
                y[t * rows + r] = (0..cols)
                    .map(|c| f64::from(x[t * cols + c]) * f64::from(deq[r * cols + c]))
                    .sum();
            }
        }
        y
    }

    /// Checks `matmul` on both paths (fused dots and tiles) against the f64 reference.
    pub fn check_matmul(w: &dyn super::WeightMatrix) {
        for n in [1, 3, super::GEMM_MIN_ROWS + 1] {
            let x = values(n * w.cols(), n as u64 + 7, 1.0);
            let y = super::matmul(w, &x, n);
            let want = reference(w, &x, n);
            for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                let tol = 1e-5 * (1.0 + want.abs()) * (w.cols() as f64).sqrt();
                assert!(
                    (f64::from(got) - want).abs() <= tol,
                    "{} n={n} element {i}: {got} vs {want}",
                    w.storage()
                );
            }
        }
    }
}
