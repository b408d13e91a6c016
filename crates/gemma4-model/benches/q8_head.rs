//! The tied output head of the demo model's shape (262144 × 640): our exact
//! Q8_0 kernel against candle's f32 matmul over the dequantized table, one
//! decode token at a time. Prints milliseconds per call and the ratio.

use std::time::Instant;

use candle_core::{Device, Tensor};
use gemma4_model::q8::{Q8Matrix, BLOCK, BLOCK_BYTES};

fn main() {
    let (rows, cols) = (262_144usize, 640usize);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut data = Vec::with_capacity(rows * cols / BLOCK * BLOCK_BYTES);
    let mut dense = Vec::with_capacity(rows * cols);
    for _ in 0..rows * cols / BLOCK {
        let d = half::f16::from_f32(0.01);
        data.extend_from_slice(&d.to_le_bytes());
        for _ in 0..BLOCK {
            let q = (next() % 255) as i64 - 127;
            data.push(q as i8 as u8);
            dense.push(d.to_f32() * q as f32);
        }
    }
    let q8 = Q8Matrix::new(data, rows, cols).expect("sizes");
    let w = Tensor::from_vec(dense, (rows, cols), &Device::Cpu).expect("tensor");
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let xt = Tensor::from_vec(x.clone(), (1, cols), &Device::Cpu).expect("x");
    let reps = 10;
    let _ = xt.matmul(&w.t().expect("t")).expect("warm");
    let t = Instant::now();
    for _ in 0..reps {
        let _ = xt.matmul(&w.t().expect("t")).expect("matmul");
    }
    let f32_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    let _ = q8.matmul(&x, 1);
    let t = Instant::now();
    for _ in 0..reps {
        let _ = q8.matmul(&x, 1);
    }
    let q8_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    println!(
        "head 262144x640, one token: candle f32 {f32_ms:.1} ms, exact Q8_0 {q8_ms:.1} ms ({:.2}x)",
        f32_ms / q8_ms
    );
}
