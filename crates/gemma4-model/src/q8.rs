//! An exact matrix product over Q8_0 weights.
//!
//! A Q8_0 block is an f16 scale `d` and 32 signed bytes `q`; its values are
//! `d · q`, exactly representable in f32. candle's quantized matmul also
//! rounds the *activations* to 8 bits, which moves logits; this kernel keeps
//! activations in f32 and reads the weights as stored (a quarter of the
//! bytes of an f32 copy), so it matches the dequantized f32 product up to
//! summation order. It serves the tied output head of GGUF models whose
//! embedding table is Q8_0 (the largest matrix, read once per decoded
//! token); `benches/q8_head.rs` measures it against candle's f32 matmul.

use half::f16;

/// Bytes per Q8_0 block: f16 scale + 32 quants.
pub const BLOCK_BYTES: usize = 34;
/// Values per block.
pub const BLOCK: usize = 32;

/// A `[rows, cols]` matrix of Q8_0 blocks, row-major, split into the
/// quants and their scales (widened to f32 once) so the inner loop is plain
/// multiply-adds the compiler vectorizes.
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    quants: Vec<i8>,
    scales: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Q8Matrix {
    /// Takes raw GGUF Q8_0 data; `None` when the sizes disagree.
    pub fn new(data: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(BLOCK) || data.len() != rows * cols / BLOCK * BLOCK_BYTES {
            return None;
        }
        let blocks = rows * cols / BLOCK;
        let mut quants = Vec::with_capacity(blocks * BLOCK);
        let mut scales = Vec::with_capacity(blocks);
        for b in data.chunks_exact(BLOCK_BYTES) {
            scales.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            quants.extend(b[2..].iter().map(|&q| q as i8));
        }
        Some(Self {
            quants,
            scales,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `y[t, r] = Σ_c x[t, c] · W[r, c]` for `x` of `n` rows of `cols` values.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.rows];
        let threads = worker_threads().min(self.rows.max(1));
        let per = self.rows.div_ceil(threads);
        // Each thread owns a range of weight rows, so every weight byte is read once per call.
        let mut parts: Vec<Vec<f32>> = Vec::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (start, end) = (t * per, ((t + 1) * per).min(self.rows));
                    s.spawn(move || self.rows_product_dispatch(x, n, start, end))
                })
                .collect();
            parts = handles
                .into_iter()
                // A worker's panic is re-raised here, never replaced by zeros.
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect();
        });
        for (t, part) in parts.iter().enumerate() {
            let start = t * per;
            let len = part.len() / n.max(1);
            for tok in 0..n {
                y[tok * self.rows + start..tok * self.rows + start + len]
                    .copy_from_slice(&part[tok * len..(tok + 1) * len]);
            }
        }
        y
    }

    /// Picks the widest instruction set this CPU has, at run time.
    fn rows_product_dispatch(&self, x: &[f32], n: usize, start: usize, end: usize) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports the features the function is compiled for.
                return unsafe { self.rows_product_avx2(x, n, start, end) };
            }
        }
        self.rows_product(x, n, start, end)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_product_avx2(&self, x: &[f32], n: usize, start: usize, end: usize) -> Vec<f32> {
        self.rows_product(x, n, start, end)
    }

    /// Products for weight rows `start..end`, laid out `[n, end - start]`.
    #[inline(always)]
    fn rows_product(&self, x: &[f32], n: usize, start: usize, end: usize) -> Vec<f32> {
        let len = end.saturating_sub(start);
        let mut out = vec![0f32; n * len];
        let per_row = self.cols / BLOCK;
        for r in start..end {
            let quants = &self.quants[r * self.cols..(r + 1) * self.cols];
            let scales = &self.scales[r * per_row..(r + 1) * per_row];
            for tok in 0..n {
                let xs = &x[tok * self.cols..(tok + 1) * self.cols];
                // Eight lanes of partial sums, reduced once per row.
                let mut acc = [0f32; 8];
                for ((q, xb), &d) in quants
                    .chunks_exact(BLOCK)
                    .zip(xs.chunks_exact(BLOCK))
                    .zip(scales)
                {
                    let mut block = [0f32; 8];
                    for (q8, x8) in q.chunks_exact(8).zip(xb.chunks_exact(8)) {
                        for k in 0..8 {
                            block[k] += f32::from(q8[k]) * x8[k];
                        }
                    }
                    for k in 0..8 {
                        acc[k] += d * block[k];
                    }
                }
                out[tok * len + (r - start)] = acc.iter().sum();
            }
        }
        out
    }
}

/// The thread count the tensor library uses (`RAYON_NUM_THREADS`, else one per core).
fn worker_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Quantizes rows to Q8_0 the way ggml does (d = max|x| / 127).
    fn quantize(values: &[f32], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for row in values.chunks(cols) {
            for block in row.chunks(BLOCK) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        out
    }

    #[test]
    fn matches_the_dequantized_product() {
        let (rows, cols, n) = (37, 96, 3);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.3)
            .collect();
        let m = Q8Matrix::new(quantize(&w, cols), rows, cols).expect("sizes");
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 104729 % 777) as f32 / 388.0) - 1.0)
            .collect();
        // Reference: dequantize the raw blocks, then a plain f64 product.
        let raw = quantize(&w, cols);
        let deq: Vec<f32> = raw
            .chunks_exact(BLOCK_BYTES)
            .flat_map(|b| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                b[2..]
                    .iter()
                    .map(move |&q| d * f32::from(q as i8))
                    .collect::<Vec<_>>()
            })
            .collect();
        let y = m.matmul(&x, n);
        for t in 0..n {
            for r in 0..rows {
                let want: f64 = (0..cols)
                    .map(|c| f64::from(x[t * cols + c]) * f64::from(deq[r * cols + c]))
                    .sum();
                assert!((f64::from(y[t * rows + r]) - want).abs() < 1e-4, "{t},{r}");
            }
        }
        assert!(Q8Matrix::new(vec![0; 10], 1, 32).is_none());
    }

    #[test]
    fn a_worker_panic_is_never_zeros() {
        let (rows, cols) = (64, 32);
        let m =
            Q8Matrix::new(vec![0; rows * cols / BLOCK * BLOCK_BYTES], rows, cols).expect("sizes");
        // Too few activations for two rows: every worker indexes past the end and panics.
        let short = vec![1f32; cols];
        let result = std::panic::catch_unwind(|| m.matmul(&short, 2));
        assert!(result.is_err(), "got {:?}", result.map(|y| y.len()));
    }
}
