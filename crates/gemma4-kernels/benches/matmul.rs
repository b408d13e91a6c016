//! `y = x · Wᵀ` for every storage type, decode (1 row), batched decode (4
//! rows) and prefill (64 and 128 rows), against the `gemm` crate's f32 product on a
//! widened copy, run in the same process. Quantized types are timed with
//! f32 activations (`exact`) and with their integer kernel (`int8 act`).
//! Prints milliseconds per call and the ratio to gemm.

mod common;

use common::{blocks, time, values};

use gemma4_kernels::block32_x8;
use gemma4_kernels::float::{FloatMatrix, FloatType};
use gemma4_kernels::int8::Int8Matrix;
use gemma4_kernels::intdot::has_vnni;
use gemma4_kernels::kquant::{self, SuperBlockMatrix};
use gemma4_kernels::kquant_x8;
use gemma4_kernels::legacy::{self, BlockMatrix};
use gemma4_kernels::q4::Q4Matrix;
use gemma4_kernels::q8_0::{self, Q8_0Matrix};
use gemma4_kernels::{matmul_with, Bytes, Precision, Rearranged, WeightMatrix, GEMM_MIN_ROWS};

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
    // Our products split their rows over as many threads as the baseline
    // (`RAYON_NUM_THREADS`, default one per core).
    gemma4_kernels::pool::set_threads(rayon::current_num_threads());
    // `MATMUL_SHAPE=262144x640` times another shape (default 2048x2048).
    let (rows, cols) = std::env::var("MATMUL_SHAPE")
        .ok()
        .and_then(|v| {
            let (r, c) = v.split_once('x')?;
            Some((r.parse().ok()?, c.parse().ok()?))
        })
        .unwrap_or((2048, 2048));
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
    let mut mats: Vec<Box<dyn WeightMatrix>> = vec![
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
        Box::new(
            BlockMatrix::<legacy::Q4_0>::new(blocks(rows, cols, 32, 18, &[0]), rows, cols)
                .expect("shape"),
        ),
        Box::new(
            BlockMatrix::<legacy::Q4_1>::new(blocks(rows, cols, 32, 20, &[0, 2]), rows, cols)
                .expect("shape"),
        ),
        Box::new(
            BlockMatrix::<legacy::Q5_0>::new(blocks(rows, cols, 32, 22, &[0]), rows, cols)
                .expect("shape"),
        ),
        Box::new(
            BlockMatrix::<legacy::Q5_1>::new(blocks(rows, cols, 32, 24, &[0, 2]), rows, cols)
                .expect("shape"),
        ),
    ];
    // The k-quants' super-blocks need rows a multiple of 256 wide.
    if cols % 256 == 0 {
        mats.extend::<[Box<dyn WeightMatrix>; 3]>([
            Box::new(
                SuperBlockMatrix::<kquant::Q4K>::new(
                    blocks(rows, cols, 256, 144, &[0, 2]),
                    rows,
                    cols,
                )
                .expect("shape"),
            ),
            Box::new(
                SuperBlockMatrix::<kquant::Q5K>::new(
                    blocks(rows, cols, 256, 176, &[0, 2]),
                    rows,
                    cols,
                )
                .expect("shape"),
            ),
            Box::new(
                SuperBlockMatrix::<kquant::Q6K>::new(
                    blocks(rows, cols, 256, 210, &[208]),
                    rows,
                    cols,
                )
                .expect("shape"),
            ),
        ]);
    }
    // Q4_K and Q6_K with eight rows interleaved, as loaded where VNNI is present.
    if cols % 256 == 0 && rows % kquant_x8::ROWS == 0 {
        let q4k = blocks(rows, cols, 256, 144, &[0, 2]);
        let q6k = blocks(rows, cols, 256, 210, &[208]);
        mats.extend::<[Box<dyn WeightMatrix>; 2]>([
            Box::new(kquant_x8::Q4KRows8::from_gguf(q4k.as_slice(), rows, cols).expect("shape")),
            Box::new(kquant_x8::Q6KRows8::from_gguf(q6k.as_slice(), rows, cols).expect("shape")),
        ]);
    }
    // Q8_0, Q4_0 and Q5_0 with eight rows interleaved, as loaded where VNNI is present.
    if rows % block32_x8::ROWS == 0 {
        let q8 = q8_0::quantize(&w, cols);
        let q4_0 = blocks(rows, cols, 32, 18, &[0]);
        let q5_0 = blocks(rows, cols, 32, 22, &[0]);
        mats.extend::<[Box<dyn WeightMatrix>; 3]>([
            Box::new(block32_x8::Q8_0Rows8::from_gguf(&q8, rows, cols).expect("shape")),
            Box::new(block32_x8::Q4_0Rows8::from_gguf(q4_0.as_slice(), rows, cols).expect("shape")),
            Box::new(block32_x8::Q5_0Rows8::from_gguf(q5_0.as_slice(), rows, cols).expect("shape")),
        ]);
    }
    // `cargo bench … -- Q8_0 int8` times only the storage types named.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mats: Vec<_> = mats
        .into_iter()
        .filter(|m| only.is_empty() || only.iter().any(|o| o == m.storage()))
        .collect();
    println!("{rows}x{cols}, {} threads", rayon::current_num_threads());
    // `MATMUL_N=1,4` times only those activation row counts.
    let ns: Vec<usize> = std::env::var("MATMUL_N")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 64, 128]);
    for n in ns {
        let x = values(n * cols, 7);
        let reps = match n {
            1 => 200,
            4 => 100,
            _ => 10,
        };
        let base = time(reps, || {
            std::hint::black_box(gemm_f32(&w, rows, cols, &x, n));
        });
        println!("n={n:<3} gemm f32 (baseline) {base:8.3} ms");
        for m in &mats {
            // Without VNNI, products of GEMM_MIN_ROWS rows or more keep f32
            // activations in either mode.
            let integer = n < GEMM_MIN_ROWS || has_vnni();
            let modes: &[(Precision, &str)] = if m.integer().is_some() && integer {
                &[
                    (Precision::Exact, "exact"),
                    (Precision::Int8Activations, "int8 act"),
                ]
            } else {
                &[(Precision::Exact, "exact")]
            };
            for &(p, label) in modes {
                let t = time(reps, || {
                    std::hint::black_box(matmul_with(m.as_ref(), &x, n, p));
                });
                println!(
                    "n={n:<3} {:<6} {label:<8} {:>5.1} MB  {t:8.3} ms  {:5.2}x gemm f32",
                    m.storage(),
                    m.stored_bytes() as f64 / 1e6,
                    base / t
                );
            }
        }
    }
}
