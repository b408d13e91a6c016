//! How fast one thread streams a decode product's weights in the row orders a
//! kernel could take: Q8_0-shaped rows (20 blocks of 34 bytes, the demo's
//! head) through the AVX2 block product, one row at a time, neighbouring rows
//! in pairs (with and without a software prefetch 1 KiB ahead) and pairs of
//! rows half the matrix apart, against a plain sum of the same bytes, in the
//! same process. Prints GB/s (medians of 21 interleaved passes) and the ratio
//! to the sum. The decode kernels pair far rows for what this shows.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    pub const COLS: usize = 640;
    const BLOCK: usize = 34;

    /// A plain sum of the bytes, four registers at a time.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sum(p: &[u8]) -> i64 {
        let mut acc = [_mm256_setzero_si256(); 4];
        for chunk in p.chunks_exact(128) {
            for (k, a) in acc.iter_mut().enumerate() {
                let v = _mm256_loadu_si256(chunk.as_ptr().add(32 * k) as *const __m256i);
                *a = _mm256_add_epi64(*a, _mm256_sad_epu8(v, _mm256_setzero_si256()));
            }
        }
        let mut out = [0i64; 4];
        let t = _mm256_add_epi64(
            _mm256_add_epi64(acc[0], acc[1]),
            _mm256_add_epi64(acc[2], acc[3]),
        );
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, t);
        out.iter().sum()
    }

    /// `R` rows at a time, `stride` rows apart (1: neighbours), each block
    /// as the decode kernel reads it: f16 scale, 32 signed bytes, sign moves,
    /// `vpmaddubsw`, `vpmaddwd`, one FMA.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const R: usize>(
        p: &[u8],
        act: &[i8],
        out: &mut [f32],
        stride: usize,
        prefetch: usize,
    ) {
        let blocks = COLS / 32;
        let row_bytes = blocks * BLOCK;
        let n = p.len() / row_bytes;
        let ones = _mm256_set1_epi16(1);
        let starts: Vec<usize> = (0..n).filter(|r| (r / stride).is_multiple_of(R)).collect();
        for r in starts {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let a = _mm256_loadu_si256(act.as_ptr().add(32 * b) as *const __m256i);
                for (i, acc) in acc.iter_mut().enumerate() {
                    let blk = p.as_ptr().add((r + i * stride) * row_bytes + b * BLOCK);
                    if prefetch > 0 {
                        _mm_prefetch(blk.wrapping_add(prefetch) as *const i8, _MM_HINT_T0);
                    }
                    let d = _mm256_cvtph_ps(_mm_set1_epi16((blk as *const i16).read_unaligned()));
                    let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                    let s = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)),
                        ones,
                    );
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
                out[r + i * stride] = lanes.iter().sum();
            }
        }
    }
}

/// One timed pass over the weights, writing the rows' products.
#[cfg(target_arch = "x86_64")]
type Pass<'a> = dyn Fn(&mut [f32]) + 'a;

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    use x86::*;
    if !(is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c"))
    {
        println!("no AVX2+FMA+F16C: nothing to time");
        return;
    }
    let n_rows = 262_144;
    let row_bytes = COLS / 32 * 34;
    let bytes: Vec<u8> = (0..n_rows * row_bytes)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_shr(13) as u8 & 0x3F)
        .collect();
    let act: Vec<i8> = (0..COLS).map(|i| ((i * 37) % 255) as i8).collect();
    let mut out = vec![0f32; n_rows];
    let half = n_rows / 2;
    let orders: [(&str, &Pass); 5] = [
        ("plain sum (baseline)", &|_| {
            std::hint::black_box(unsafe { sum(&bytes) });
        }),
        ("one row at a time", &|o| unsafe {
            rows::<1>(&bytes, &act, o, 1, 0)
        }),
        ("neighbouring pairs", &|o| unsafe {
            rows::<2>(&bytes, &act, o, 1, 0)
        }),
        ("neighbouring pairs, prefetch 1 KiB", &|o| unsafe {
            rows::<2>(&bytes, &act, o, 1, 1024)
        }),
        ("pairs half the rows apart", &|o| unsafe {
            rows::<2>(&bytes, &act, o, half, 0)
        }),
    ];
    let mut rates = vec![Vec::new(); orders.len()];
    for _ in 0..21 {
        for (k, (_, f)) in orders.iter().enumerate() {
            let t = Instant::now();
            f(&mut out);
            std::hint::black_box(&out);
            rates[k].push(bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut rates[0]);
    println!("{n_rows} rows of {row_bytes} bytes (Q8_0, {COLS} wide), 1 thread");
    for (k, (name, _)) in orders.iter().enumerate() {
        let r = median(&mut rates[k]);
        println!("{name:<36} {r:6.1} GB/s  {:5.2}x the sum", r / base);
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86-64 only");
}
