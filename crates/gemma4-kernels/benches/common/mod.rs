//! What the kernel benches share.

use std::time::Instant;

use gemma4_kernels::Bytes;

/// Milliseconds per call of `f` over `reps` calls, after one untimed call.
pub fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}

/// Varied values in [-0.5, 0.5) (the matmul and decode-chain benches).
#[allow(dead_code)]
pub fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect()
}

/// Block bytes of a `[rows, cols]` matrix, `bytes` per `per` values, with
/// sane f16 scales at offsets `halves` of each block (the matmul and
/// decode-chain benches).
#[allow(dead_code)]
pub fn blocks(rows: usize, cols: usize, per: usize, bytes: usize, halves: &[usize]) -> Bytes {
    let n = rows * cols / per;
    let raw = values(n * bytes, 3);
    let mut out: Vec<u8> = raw.iter().map(|v| ((v + 0.5) * 255.0) as u8).collect();
    for blk in out.chunks_exact_mut(bytes) {
        for &at in halves {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    Bytes::from_vec(out)
}
