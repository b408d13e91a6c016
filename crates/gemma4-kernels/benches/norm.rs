//! RMSNorm of a decode step's hidden vectors (4 rows of 1536, E2B's width)
//! and of a prompt's (512 rows): the kernels' one pass (a copy of the input
//! included) against the same steps as separate scalar passes over freshly
//! allocated buffers (the shape of the tensor operations it replaces,
//! without their vectorized sum or their dispatch), in the same process. Prints microseconds per call and
//! the ratio.

mod common;

use common::time;

use gemma4_kernels::norm::rms_norm;

fn passes(x: &[f32], d: usize, w: &[f32]) -> Vec<f32> {
    let sq: Vec<f32> = x.iter().map(|v| v * v).collect();
    let ms: Vec<f32> = sq
        .chunks_exact(d)
        .map(|r| r.iter().sum::<f32>() * (1.0 / d as f64) as f32)
        .collect();
    let inv: Vec<f32> = ms.iter().map(|m| 1.0 / (m + 1e-6).sqrt()).collect();
    let y: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * inv[i / d]).collect();
    y.iter().enumerate().map(|(i, v)| v * w[i % d]).collect()
}

fn main() {
    let d = 1536;
    let w: Vec<f32> = (0..d).map(|i| 1.0 + (i % 13) as f32 * 0.01).collect();
    println!("rows of {d}, 1 thread");
    for rows in [4, 512] {
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i % 2001) as f32 - 1000.0) * 0.003)
            .collect();
        let reps = if rows < 16 { 20_000 } else { 200 };
        let base = time(reps, || {
            std::hint::black_box(passes(&x, d, &w));
        }) * 1e3;
        let mut out = x.clone();
        let ours = time(reps, || {
            out.copy_from_slice(&x);
            rms_norm(&mut out, d, 1e-6, &w);
            std::hint::black_box(&out);
        }) * 1e3;
        println!("{rows:>4} rows: scalar passes (baseline) {base:9.2} us   rms_norm {ours:9.2} us   {:.2}x", base / ours);
    }
}
