//! A decode step's products one after another, as an E2B-shaped Q4_K_M
//! model makes them (35 layers: q/k/v joined, o, gate/up joined, down, the
//! per-layer input gate and projection; the last 20 layers share their keys
//! and values and have an MLP twice as wide), one activation row, every
//! matrix in the eight-row interleaved Q4_K layout, about 1 GB in all.
//! Against it, in the same process and interleaved, one 116 MB matrix of the
//! same layout: the gap between the two read rates is what 210 products'
//! starts, claims, ends and read-ahead cost over one large read. And a
//! plain read of as many bytes by the same threads (`bandwidth`): the gap
//! between the large matrix and it is what the kernel's work costs over
//! the memory's rate. Prints the median GB/s of each and their ratios, then
//! the rate of each kind of product. `CHAIN_LAYERS=N` shortens the chain.
//!
//! The memory of a shared machine can change speed while this runs; the
//! ratio is taken pass by pass, so read it rather than the rates.

mod common;

use std::time::Instant;

use common::{blocks, time};

use gemma4_kernels::kquant_x8::Q4KRows8;
use gemma4_kernels::{matmul_many, Precision, Rearranged, WeightMatrix};

const HIDDEN: usize = 1536;
const PER_LAYER: usize = 256;
const KINDS: [&str; 6] = [
    "q/k/v",
    "o",
    "gate/up",
    "down",
    "per-layer gate",
    "per-layer projection",
];

/// A Q4_K matrix of varied codes and sane scales, rearranged as a load on
/// a VNNI machine holds it.
fn q4k(rows: usize, cols: usize) -> Q4KRows8 {
    let gguf = blocks(rows, cols, 256, 144, &[0, 2]);
    Q4KRows8::from_gguf(gguf.as_slice(), rows, cols).expect("whole groups of eight rows")
}

/// The products of one decode step: each entry is the matrices that read
/// the same activation row (joined into one product, as the model does).
fn step_products(layers: usize) -> Vec<Vec<Q4KRows8>> {
    let mut products = Vec::with_capacity(layers * KINDS.len());
    for layer in 0..layers {
        let shares_kv = layer >= 15;
        let ffn = if shares_kv { 2 * 6144 } else { 6144 };
        let mut qkv = vec![q4k(2048, HIDDEN)];
        if !shares_kv {
            qkv.push(q4k(256, HIDDEN));
            qkv.push(q4k(256, HIDDEN));
        }
        products.push(qkv);
        products.push(vec![q4k(HIDDEN, 2048)]);
        products.push(vec![q4k(ffn, HIDDEN), q4k(ffn, HIDDEN)]);
        products.push(vec![q4k(HIDDEN, ffn)]);
        products.push(vec![q4k(PER_LAYER, HIDDEN)]);
        products.push(vec![q4k(HIDDEN, PER_LAYER)]);
    }
    products
}

fn bytes(ms: &[Q4KRows8]) -> usize {
    ms.iter().map(|m| m.stored_bytes()).sum()
}

fn product(ms: &[Q4KRows8], x: &[f32]) {
    let refs: Vec<&dyn WeightMatrix> = ms.iter().map(|m| m as &dyn WeightMatrix).collect();
    std::hint::black_box(matmul_many(
        &refs,
        &x[..ms[0].cols()],
        1,
        Precision::Int8Activations,
    ));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let layers: usize = std::env::var("CHAIN_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(35);
    let products = step_products(layers);
    let chain_bytes: usize = products.iter().map(|ms| bytes(ms)).sum();
    let one = [q4k(131_072, HIDDEN)];
    let x: Vec<f32> = (0..2 * 6144).map(|i| (i as f32 * 0.37).sin()).collect();
    println!(
        "{layers} layers: {} products, {:.1} MB; one matrix {:.1} MB; {} threads",
        products.len(),
        chain_bytes as f64 / 1e6,
        bytes(&one) as f64 / 1e6,
        gemma4_kernels::pool::global().threads()
    );
    let (mut chain, mut single, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ratio, mut of_plain) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        let c =
            chain_bytes as f64 / time(3, || products.iter().for_each(|ms| product(ms, &x))) / 1e6;
        let s = bytes(&one) as f64 / time(6, || product(&one, &x)) / 1e6;
        let p = gemma4_kernels::bandwidth::read_bandwidth(bytes(&one), 3) / 1e9;
        chain.push(c);
        single.push(s);
        plain.push(p);
        ratio.push(c / s);
        of_plain.push(s / p);
    }
    println!(
        "chain {:5.1} GB/s   one matrix {:5.1} GB/s   plain read {:5.1} GB/s",
        median(chain),
        median(single),
        median(plain),
    );
    println!(
        "chain / one {:.2}   one / plain read {:.2} (medians of 9 pass ratios)",
        median(ratio),
        median(of_plain)
    );
    // Each kind's share: timed one product at a time over five steps.
    let mut seconds = [0f64; KINDS.len()];
    let mut read = [0usize; KINDS.len()];
    for _ in 0..5 {
        for (i, ms) in products.iter().enumerate() {
            let t = Instant::now();
            product(ms, &x);
            seconds[i % KINDS.len()] += t.elapsed().as_secs_f64();
            read[i % KINDS.len()] += bytes(ms);
        }
    }
    for (k, name) in KINDS.iter().enumerate() {
        println!(
            "  {name:<21} {:6.3} MB each  {:5.1} GB/s  {:5.2} ms per step",
            read[k] as f64 / 5.0 / layers as f64 / 1e6,
            read[k] as f64 / seconds[k] / 1e9,
            seconds[k] * 1e3 / 5.0
        );
    }
}
