//! The interleaved layouts' integer kernels on a matrix that stays in the
//! caches, one thread, called directly (no pool, activations rounded once
//! beforehand): their compute rate in GB/s of weights for 1, 2 and 4
//! activation rows, beside the row-major layout's kernel of the same format
//! where it has one. A memory-bound product keeps up with the memory only
//! when this rate is well above the memory's. Best of seven passes of 400
//! calls each.

mod common;

use common::{blocks, time, values};

use gemma4_kernels::block32_x8::{Q4_0Rows8, Q5_0Rows8, Q8_0Rows8};
use gemma4_kernels::kquant::{self, SuperBlockMatrix};
use gemma4_kernels::kquant_x8::{Q4KRows8, Q6KRows8};
use gemma4_kernels::legacy::{self, BlockMatrix};
use gemma4_kernels::q8_0::{self, Q8_0Matrix};
use gemma4_kernels::{Bytes, QuantizedActs, Rearranged, WeightMatrix};

/// GB/s of weights the integer kernel of `m` multiplies with `n` rows.
fn rate(m: &dyn WeightMatrix, n: usize) -> f64 {
    let cols = m.cols();
    let ints = m.integer().expect("an integer kernel");
    let x = values(n * cols, 7);
    let acts = QuantizedActs::quantize(&x, n, cols, ints.act_block());
    let mut out = vec![0f32; n * m.rows()];
    let best_ms = (0..7)
        .map(|_| {
            time(400, || {
                ints.int_dots(0..m.rows(), &acts, &mut out);
                std::hint::black_box(&mut out);
            })
        })
        .fold(f64::INFINITY, f64::min);
    m.stored_bytes() as f64 / best_ms / 1e6
}

fn main() {
    if !gemma4_kernels::intdot::has_vnni() {
        println!("no AVX-512 VNNI: the interleaved layouts run the row kernels here");
    }
    let (rows, cols) = (512, 2048);
    let q4k = blocks(rows, cols, 256, 144, &[0, 2]);
    let q6k = blocks(rows, cols, 256, 210, &[208]);
    let q8 = Bytes::from_vec(q8_0::quantize(&values(rows * cols, 1), cols));
    let q4_0 = blocks(rows, cols, 32, 18, &[0]);
    let q5_0 = blocks(rows, cols, 32, 22, &[0]);
    let mats: Vec<Box<dyn WeightMatrix>> = vec![
        Box::new(SuperBlockMatrix::<kquant::Q4K>::new(q4k.clone(), rows, cols).expect("shape")),
        Box::new(Q4KRows8::from_gguf(q4k.as_slice(), rows, cols).expect("shape")),
        Box::new(SuperBlockMatrix::<kquant::Q6K>::new(q6k.clone(), rows, cols).expect("shape")),
        Box::new(Q6KRows8::from_gguf(q6k.as_slice(), rows, cols).expect("shape")),
        Box::new(Q8_0Matrix::new(q8.clone(), rows, cols).expect("shape")),
        Box::new(Q8_0Rows8::from_gguf(q8.as_slice(), rows, cols).expect("shape")),
        Box::new(BlockMatrix::<legacy::Q4_0>::new(q4_0.clone(), rows, cols).expect("shape")),
        Box::new(Q4_0Rows8::from_gguf(q4_0.as_slice(), rows, cols).expect("shape")),
        Box::new(BlockMatrix::<legacy::Q5_0>::new(q5_0.clone(), rows, cols).expect("shape")),
        Box::new(Q5_0Rows8::from_gguf(q5_0.as_slice(), rows, cols).expect("shape")),
    ];
    println!("{rows}x{cols}, one thread, GB/s of weights");
    for m in &mats {
        let rates: Vec<String> = [1, 2, 4]
            .iter()
            .map(|&n| format!("n={n} {:6.1}", rate(m.as_ref(), n)))
            .collect();
        println!(
            "{:<7} {:5.2} MB  {}",
            m.storage(),
            m.stored_bytes() as f64 / 1e6,
            rates.join("  ")
        );
    }
}
