//! Soft-capping one step's logits (262,144 values, Gemma's vocabulary):
//! the kernel's vectorized pass against the scalar form (what the tensor
//! library computes, with libm's `tanhf`), in the same process. Prints
//! milliseconds per call and the ratio.

mod common;

use common::time;

use gemma4_kernels::softcap::softcap;

fn main() {
    let n = 262_144;
    let cap = 30.0f32;
    let logits: Vec<f32> = (0..n)
        .map(|i| ((i % 4001) as f32 - 2000.0) * 0.02)
        .collect();
    let mut out = logits.clone();
    let scalar = time(50, || {
        for (o, &x) in out.iter_mut().zip(&logits) {
            *o = (x / cap).tanh() * cap;
        }
        std::hint::black_box(&out);
    });
    let ours = time(50, || {
        out.copy_from_slice(&logits);
        softcap(cap, &mut out);
        std::hint::black_box(&out);
    });
    println!("{n} values, 1 thread");
    println!("scalar tanhf form (baseline)  {scalar:8.3} ms");
    println!(
        "softcap (copy included)       {ours:8.3} ms   {:.2}x",
        scalar / ours
    );
}
