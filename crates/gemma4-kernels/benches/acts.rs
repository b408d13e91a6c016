//! Activations rounded to 8 bits per block (the integer kernels' operand)
//! for a prompt's MLP input, 512 rows of 2048: the value-by-value form with
//! a saturating cast (baseline) against `round_blocks` on one thread and
//! `QuantizedActs::quantize` over the pool, in the same process. Prints
//! milliseconds per call and the ratios.

mod common;

use common::{time, values};

use gemma4_kernels::acts::round_blocks;
use gemma4_kernels::{ActBlock, QuantizedActs};

fn main() {
    let (n, cols) = (512, 2048);
    let x = values(n * cols, 5);
    let mut qs = vec![0i8; n * cols];
    let mut scales = vec![0f32; n * cols / 32];
    let mut sums = vec![0i32; n * cols / 16];
    let scalar = time(20, || {
        for ((xb, qb), d) in x
            .chunks_exact(32)
            .zip(qs.chunks_exact_mut(32))
            .zip(scales.iter_mut())
        {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            *d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
        }
        for (s, g) in sums.iter_mut().zip(qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| i32::from(q)).sum();
        }
        std::hint::black_box((&qs, &scales, &sums));
    });
    let one = time(20, || {
        round_blocks(&x, 32, &mut qs, &mut scales, &mut sums);
        std::hint::black_box((&qs, &scales, &sums));
    });
    let pooled = time(20, || {
        std::hint::black_box(QuantizedActs::quantize(&x, n, cols, ActBlock::B32));
    });
    let threads = gemma4_kernels::pool::global().threads();
    println!("{n} rows of {cols} values, blocks of 32");
    println!("value by value, saturating cast (baseline)  {scalar:8.3} ms");
    println!(
        "round_blocks, 1 thread                      {one:8.3} ms   {:.2}x",
        scalar / one
    );
    println!(
        "QuantizedActs::quantize, {threads} threads          {pooled:8.3} ms   {:.2}x",
        scalar / pooled
    );
}
