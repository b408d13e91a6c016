//! `gelu_pytorch_tanh(gate) · up` over an MLP's worth of values (512 rows of
//! 2048), the kernels' vectorized pass against the scalar tanh form (what
//! the tensor library computes, with libm's `tanhf`), in the same process.
//! Prints milliseconds per call and the ratio.

mod common;

use common::time;

use gemma4_kernels::gelu::gelu_tanh_mul;

fn main() {
    let n = 512 * 2048;
    let gate: Vec<f32> = (0..n)
        .map(|i| ((i % 2001) as f32 - 1000.0) * 0.004)
        .collect();
    let up: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
    let mut out = vec![0f32; n];
    let scalar = time(20, || {
        for ((o, &g), &u) in out.iter_mut().zip(&gate).zip(&up) {
            let t = (0.797_884_6f32 * g * (1.0 + 0.044_715 * g * g)).tanh();
            *o = 0.5 * g * (1.0 + t) * u;
        }
        std::hint::black_box(&out);
    });
    let ours = time(20, || {
        gelu_tanh_mul(&gate, &up, &mut out);
        std::hint::black_box(&out);
    });
    println!("{n} values, 1 thread");
    println!("scalar tanh form (baseline)  {scalar:8.3} ms");
    println!(
        "gelu_tanh_mul                {ours:8.3} ms   {:.2}x",
        scalar / ours
    );
}
