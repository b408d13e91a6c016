//! The memory's read bandwidth as the product kernels meet it: the pool's
//! threads together sum a buffer in the arena's huge pages, the memory every
//! weight lives in, larger than any cache. A decode step of a dense model
//! reads each weight once, so bytes per token over this rate is its
//! roofline, measured in the same process as the decode it judges.

use std::time::Instant;

/// Bytes per second of the fastest of `reps` passes over `bytes` bytes
/// (rounded down to whole 64-byte lines), every pool thread summing its
/// chunks at once; the wall time of a whole pass counts, so the threads'
/// shares overlap as a product's do. 0.0 when nothing is read.
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let bytes = bytes / 64 * 64;
    if bytes == 0 || reps == 0 {
        return 0.0;
    }
    let mut buffer = crate::arena::alloc_zeroed(bytes);
    let pool = crate::pool::global();
    // Chunks of 4 MiB: several per thread whatever the size, as products split their rows.
    const CHUNK: usize = 4 << 20;
    // Written first, so every page is present and none is a shared zero page.
    pool.for_each_chunk(buffer.as_mut_slice(), CHUNK, &|i, part| {
        for (j, b) in part.iter_mut().enumerate() {
            *b = (i + j) as u8;
        }
    });
    let data = buffer.as_slice();
    let chunks = data.len().div_ceil(CHUNK);
    let mut best = f64::INFINITY;
    let mut check = 0u64;
    for _ in 0..reps {
        let start = Instant::now();
        let sums = pool.map(chunks, &|i| {
            sum_words(&data[i * CHUNK..((i + 1) * CHUNK).min(data.len())])
        });
        best = best.min(start.elapsed().as_secs_f64());
        check = check.wrapping_add(sums.iter().fold(0u64, |a, &s| a.wrapping_add(s)));
    }
    // The sums are used, so the reads cannot be left out.
    std::hint::black_box(check);
    bytes as f64 / best.max(f64::MIN_POSITIVE)
}

/// The wrapping sum of `bytes` read as little-endian 64-bit words (a
/// length that is a multiple of 64), in eight independent lanes so the
/// additions keep up with the memory.
fn sum_words(bytes: &[u8]) -> u64 {
    let mut lanes = [0u64; 8];
    for line in bytes.chunks_exact(64) {
        for (lane, word) in lanes.iter_mut().zip(line.chunks_exact(8)) {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            *lane = lane.wrapping_add(w);
        }
    }
    lanes.iter().fold(0, |a, &l| a.wrapping_add(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_summed_whole() {
        let bytes: Vec<u8> = (0..128u32).map(|i| i as u8).collect();
        let want = bytes
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .fold(0u64, |a, w| a.wrapping_add(w));
        assert_eq!(sum_words(&bytes), want);
    }

    #[test]
    fn a_pass_reports_a_finite_rate() {
        let rate = read_bandwidth(8 << 20, 2);
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        assert_eq!(read_bandwidth(0, 3), 0.0);
        assert_eq!(read_bandwidth(63, 3), 0.0);
    }
}
