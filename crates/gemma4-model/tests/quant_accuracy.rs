//! What quantization on load costs, against the Hugging Face float32
//! reference: top-1 agreement and mean KL divergence over every prompt
//! position of every oracle fixture, for each `--quant` mode. Prints the
//! table that docs/quantization.md reports and holds each mode to bounds a
//! stated margin from what it measures.

use std::path::PathBuf;

use gemma4_model::golden::Golden;
use gemma4_model::safetensors_store::SafetensorsStore;
use gemma4_model::{load, LoadPolicy, LogitsFor, Quant};

mod divergence;

const VARIANTS: &[&str] = &["e-style", "dense-k-eq-v", "moe", "unified"];

fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(variant)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}

/// (positions, top-1 agreements, summed KL(reference ‖ ours)) of one variant.
fn measure(variant: &str, quant: Quant, exact: bool) -> (usize, usize, f64) {
    let dir = fixture(variant);
    let policy = LoadPolicy {
        quant,
        exact,
        measure_only: false,
    };
    let model = load(&dir, policy).unwrap_or_else(|e| panic!("{variant}: {e}"));
    let golden = Golden::read(&dir.join("golden.json")).expect("golden");
    let tensors =
        SafetensorsStore::open_files(&[dir.join("golden_tensors.safetensors")]).expect("tensors");
    let vocab = model.config().vocab_size;
    let (mut positions, mut agree, mut kl) = (0, 0, 0.0);
    for (i, p) in golden.prompts.iter().enumerate() {
        let n = p.input_ids.len();
        let want = tensors
            .get(&format!("prompt{i}.logits"), &[n, vocab])
            .and_then(|t| {
                t.to_vec2::<f32>()
                    .map_err(|e| gemma4_model::WeightError::Missing {
                        name: e.to_string(),
                    })
            })
            .expect("reference logits");
        // One token per step, as decoding runs: products of many rows
        // (prefill) keep f32 activations in every mode.
        let mut cache = model.new_cache();
        let got: Vec<Vec<f32>> = p
            .input_ids
            .iter()
            .map(|&id| {
                model
                    .forward(&[id], &mut cache, LogitsFor::Last, None)
                    .and_then(|t| Ok(t.squeeze(0)?.to_vec1::<f32>()?))
                    .expect("forward")
            })
            .collect();
        for (w, g) in want.iter().zip(&got) {
            positions += 1;
            agree += usize::from(argmax(w) == argmax(g));
            kl += divergence::kl(w, g);
        }
    }
    (positions, agree, kl)
}

#[test]
fn quantized_loads_stay_close_to_the_reference() {
    // (mode, exact activations, minimum top-1 agreement, maximum mean KL)
    // over all fixtures. Measured on an Intel Xeon with AVX-512 VNNI
    // (docs/quantization.md): int8 94.1% / 7.77e-3 with f32 activations,
    // 91.9% / 1.19e-2 without; q4 44.5% / 0.524 and 44.7% / 0.529. The
    // fixtures' random weights give near-ties that ulp-sized changes flip:
    // summing in another order moved int8 by a position of 577, breaking
    // q4's exact ties upwards instead of away from zero moved it from 44.7%
    // to 44.4% and 0.529 to 0.516. So each bound keeps a margin of about 2
    // points of agreement and a quarter of the KL; that llama.cpp's own
    // Q8_0 and Q4_0 files of these weights are no closer is held by
    // `llamacpp_files.rs`.
    let floors = [
        (Quant::AsStored, false, 1.0, 1e-9),
        (Quant::Int8, true, 0.92, 1.0e-2),
        (Quant::Int8, false, 0.90, 1.5e-2),
        (Quant::Q4, true, 0.42, 0.66),
        (Quant::Q4, false, 0.42, 0.66),
    ];
    println!("| mode | positions | top-1 agreement | mean KL (nats) |");
    println!("|---|---:|---:|---:|");
    for (quant, exact, min_agree, max_kl) in floors {
        let mode = format!(
            "{}{}",
            quant.name(),
            if exact { ", f32 activations" } else { "" }
        );
        let (mut positions, mut agree, mut kl) = (0, 0, 0.0);
        for v in VARIANTS {
            let (p, a, k) = measure(v, quant, exact);
            println!("  {v} {mode}: top-1 {a}/{p}, mean KL {:.3e}", k / p as f64);
            positions += p;
            agree += a;
            kl += k;
        }
        let (rate, mean_kl) = (agree as f64 / positions as f64, kl / positions as f64);
        println!(
            "| {mode} | {positions} | {:.1}% | {mean_kl:.2e} |",
            100.0 * rate
        );
        assert!(rate >= min_agree, "{mode}: top-1 agreement {rate}");
        assert!(mean_kl <= max_kl, "{mode}: mean KL {mean_kl}");
    }
}
