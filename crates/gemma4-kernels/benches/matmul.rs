//! `y = x · Wᵀ` for every storage type, decode (1 row) and prefill (64
//! rows), against the `gemm` crate's f32 product on a widened copy, run in
//! the same process. Prints milliseconds per call and the ratio to gemm.

use std::time::Instant;

use gemma4_kernels::float::{FloatMatrix, FloatType};
use gemma4_kernels::int8::Int8Matrix;
use gemma4_kernels::q4::Q4Matrix;
use gemma4_kernels::q8_0::{self, Q8_0Matrix};
use gemma4_kernels::{matmul, Bytes, WeightMatrix};

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect()
}

fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn gemm_f32(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * rows];
    let threads = rayon::current_num_threads();
    // SAFETY: x is [n, cols], w is [rows, cols], y is [n, rows].
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            y.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            w.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(threads),
        );
    }
    y
}

fn main() {
    let (rows, cols) = (2048, 2048);
    let w = values(rows * cols, 1);
    let bf16: Vec<u8> = w
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let f16: Vec<u8> = w
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let f32m = FloatMatrix::from_f32(&w, rows, cols).expect("shape");
    let mats: Vec<Box<dyn WeightMatrix>> = vec![
        Box::new(f32m.clone()),
        Box::new(
            FloatMatrix::new(Bytes::from_vec(bf16), FloatType::Bf16, rows, cols).expect("shape"),
        ),
        Box::new(
            FloatMatrix::new(Bytes::from_vec(f16), FloatType::F16, rows, cols).expect("shape"),
        ),
        Box::new(Int8Matrix::quantize(&f32m)),
        Box::new(Q4Matrix::quantize(&f32m).expect("width").0),
        Box::new(
            Q8_0Matrix::new(Bytes::from_vec(q8_0::quantize(&w, cols)), rows, cols).expect("shape"),
        ),
    ];
    println!("{rows}x{cols}, {} threads", rayon::current_num_threads());
    for n in [1usize, 64] {
        let x = values(n * cols, 7);
        let reps = if n == 1 { 200 } else { 20 };
        let base = time(reps, || {
            std::hint::black_box(gemm_f32(&w, rows, cols, &x, n));
        });
        println!("n={n:<3} gemm f32 (baseline) {base:8.3} ms");
        for m in &mats {
            let t = time(reps, || {
                std::hint::black_box(matmul(m.as_ref(), &x, n));
            });
            println!(
                "n={n:<3} {:<6} {:>5.1} MB  {t:8.3} ms  {:5.2}x gemm f32",
                m.storage(),
                m.stored_bytes() as f64 / 1e6,
                base / t
            );
        }
    }
}
