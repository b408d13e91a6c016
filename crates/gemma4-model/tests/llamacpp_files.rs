//! GGUF files written by llama.cpp's own tools (`convert_hf_to_gguf.py`,
//! then `llama-quantize` to Q8_0, Q4_0 and Q4_K_M) from the oracle
//! checkpoints, held to transformers' float32 run over the weights those
//! files hold (dequantized by llama.cpp's gguf-py). The files and the goldens
//! are made by `tests/fixtures/llamacpp/make.py`; its README says how.

use std::collections::BTreeMap;
use std::path::PathBuf;

use gemma4_model::golden::{argmax, verify_prompt, GoldenPrompt, DEFAULT_TOLERANCE};
use gemma4_model::{load, Gemma4, LoadPolicy, Quant};
use serde::Deserialize;

mod divergence;
use divergence::{forced_rows, kl};

const VARIANTS: [&str; 3] = ["e-style", "dense-k-eq-v", "moe"];

#[derive(Deserialize)]
struct Golden {
    files: BTreeMap<String, FileGolden>,
}

#[derive(Deserialize)]
struct FileGolden {
    file: String,
    prompts: Vec<serde_json::Value>,
}

impl FileGolden {
    /// Each prompt in the oracle's form, with the reference's top-1 − top-2
    /// margin at each greedy step.
    fn prompts(&self) -> Vec<(GoldenPrompt, Vec<f32>)> {
        self.prompts
            .iter()
            .map(|p| {
                let golden = serde_json::from_value(p.clone()).expect("golden prompt");
                let margins = serde_json::from_value(p["greedy"]["step_top1_top2_margin"].clone())
                    .expect("step margins");
                (golden, margins)
            })
            .collect()
    }
}

fn dir(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llamacpp")
        .join(variant)
}

fn golden(variant: &str) -> Golden {
    let path = dir(variant).join("golden.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn model(variant: &str, file: &str, exact: bool) -> Gemma4 {
    let path = dir(variant).join(file);
    let policy = LoadPolicy {
        exact,
        ..LoadPolicy::default()
    };
    load(&path, policy).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_file_in_exact_mode_gives_the_reference_logits_and_ids() {
    for variant in VARIANTS {
        for (kind, f) in golden(variant).files {
            let model = model(variant, &f.file, true);
            for (p, _) in &f.prompts() {
                let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
                let at = format!("{variant} {kind} `{}`", p.name);
                println!(
                    "{at}: max logit diff {:.2e}, first mismatch {:?}",
                    r.max_abs_logit_diff, r.first_token_mismatch
                );
                assert_eq!(r.generated_ids, p.greedy.generated_ids, "{at}");
                assert!(
                    r.top5_mismatches.is_empty(),
                    "{at}: {:?}",
                    r.top5_mismatches
                );
                assert!(
                    r.max_abs_logit_diff <= DEFAULT_TOLERANCE,
                    "{at}: {}",
                    r.max_abs_logit_diff
                );
            }
        }
    }
}

/// The reference's logits at every greedy step (`step_logits.safetensors`).
fn reference_rows(variant: &str, kind: &str, prompt: &str) -> Vec<Vec<f32>> {
    let path = dir(variant).join("step_logits.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let t = st.tensor(&format!("{kind}/{prompt}")).expect("step rows");
    let cols = t.shape()[1];
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    values.chunks(cols).map(<[f32]>::to_vec).collect()
}

/// A reference top-1 − top-2 margin above which rounding activations to 8
/// bits must not change the token: llama.cpp itself departs at margins up
/// to 0.41 on these files, and we up to 0.13 (see the README).
const CLEAR_MARGIN: f32 = 0.5;

/// How much larger than llama.cpp's our default mode's mean KL to the
/// reference may be, per storage type over the three variants and over all
/// quantized files together. Measured on an Intel Xeon with AVX-512: 1.33
/// for Q8_0 (a few MoE router flips, each worth up to 0.3 nats on one
/// row, decide it), 0.94 for Q4_0, 0.88 for Q4_K_M, 1.02 over all; a
/// rounding that is wrong rather than noisy costs many times more.
const KL_OVER_LLAMA_CPP: f64 = 2.0;
const KL_OVER_LLAMA_CPP_ALL: f64 = 1.25;

/// Sums over one file's rows, ours and llama.cpp's.
#[derive(Default, Clone, Copy)]
struct Closeness {
    rows: usize,
    kl: f64,
    llama_cpp_kl: f64,
    top1: usize,
    llama_cpp_top1: usize,
}

impl std::ops::AddAssign for Closeness {
    fn add_assign(&mut self, o: Self) {
        self.rows += o.rows;
        self.kl += o.kl;
        self.llama_cpp_kl += o.llama_cpp_kl;
        self.top1 += o.top1;
        self.llama_cpp_top1 += o.llama_cpp_top1;
    }
}

impl std::fmt::Display for Closeness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.rows as f64;
        write!(
            f,
            "mean KL {:.3e} (llama.cpp {:.3e}), top-1 {}/{} (llama.cpp {})",
            self.kl / n,
            self.llama_cpp_kl / n,
            self.top1,
            self.rows,
            self.llama_cpp_top1
        )
    }
}

/// llama.cpp on a file, fed a reference's greedy ids: its KL to that
/// reference and its top token at each step.
struct LlamaCpp {
    step_kl: Vec<f64>,
    step_argmax: Vec<u32>,
}

impl LlamaCpp {
    fn read(v: &serde_json::Value) -> Self {
        let field = |k: &str| v[k].clone();
        LlamaCpp {
            step_kl: serde_json::from_value(field("step_kl")).expect("step_kl"),
            step_argmax: serde_json::from_value(field("step_argmax")).expect("step_argmax"),
        }
    }
}

/// Our teacher-forced `rows` beside llama.cpp's, against the `reference`
/// rows of prompt `p`.
fn closeness(
    rows: &[Vec<f32>],
    p: &GoldenPrompt,
    reference: &[Vec<f32>],
    llama: &LlamaCpp,
) -> Closeness {
    let mut sums = Closeness::default();
    for (step, row) in rows.iter().enumerate() {
        let id = p.greedy.generated_ids[step];
        sums += Closeness {
            rows: 1,
            kl: kl(&reference[step], row),
            llama_cpp_kl: llama.step_kl[step],
            top1: usize::from(argmax(row).0 == id),
            llama_cpp_top1: usize::from(llama.step_argmax[step] == id),
        };
    }
    sums
}

/// One file in the default mode, every greedy step teacher-forced: its
/// closeness to the reference beside llama.cpp's, and the check that a
/// clear reference choice is kept.
fn default_mode_on(variant: &str, kind: &str, f: &FileGolden) -> Closeness {
    let model = model(variant, &f.file, false);
    let mut sums = Closeness::default();
    for ((p, margins), raw) in f.prompts().iter().zip(&f.prompts) {
        let rows = forced_rows(&model, &p.input_ids, &p.greedy.generated_ids);
        for (step, row) in rows.iter().enumerate() {
            if margins[step] > CLEAR_MARGIN {
                assert_eq!(
                    argmax(row).0,
                    p.greedy.generated_ids[step],
                    "{variant} {kind} `{}` step {step}: the reference's margin is {}",
                    p.name,
                    margins[step]
                );
            }
        }
        let reference = reference_rows(variant, kind, &p.name);
        sums += closeness(&rows, p, &reference, &LlamaCpp::read(&raw["llama_cpp"]));
    }
    sums
}

#[test]
fn default_mode_is_as_close_to_the_reference_as_llama_cpp_on_the_same_files() {
    let mut by_kind: BTreeMap<String, Closeness> = BTreeMap::new();
    for variant in VARIANTS {
        for (kind, f) in golden(variant).files {
            let c = default_mode_on(variant, &kind, &f);
            println!("{variant} {kind}: {c}");
            *by_kind.entry(kind).or_default() += c;
        }
    }
    let mut quantized = Closeness::default();
    for (kind, c) in &by_kind {
        println!("{kind}, all variants: {c}");
        assert!(
            c.kl <= KL_OVER_LLAMA_CPP * c.llama_cpp_kl,
            "{kind}: {c} is not within {KL_OVER_LLAMA_CPP}x llama.cpp's"
        );
        if kind != "F16" {
            quantized += *c;
        }
    }
    println!("quantized files: {quantized}");
    assert!(
        quantized.kl <= KL_OVER_LLAMA_CPP_ALL * quantized.llama_cpp_kl,
        "{quantized} is not within {KL_OVER_LLAMA_CPP_ALL}x llama.cpp's"
    );
}

/// How much larger than llama.cpp's our quantized-on-load mean KL may be.
/// Measured on an Intel Xeon with AVX-512: 1.08 for int8 against Q8_0
/// (one scale per row against one per 32 values), 1.14 for q4 against
/// Q4_0. q4 puts every weight on the level Q4_0 does, but breaks exact
/// ties (0.1% of bf16 weights) away from zero where ggml breaks them
/// upwards; rounding them ggml's way moved these tiny models' figure from
/// 0.314 to 0.29, with e-style's getting worse: the bound is for that
/// noise, not for a coarser grid.
const ON_LOAD_OVER_LLAMA_CPP: f64 = 1.5;

/// `--quant int8` and `--quant q4` on the oracle checkpoint (bf16, quantized
/// on load), in the default mode, beside llama.cpp on its Q8_0 and Q4_0
/// files of the same weights, both against the float weights' reference
/// (the F16 file's, which is the oracle's within 6e-6) with its greedy ids
/// fed back at every step.
#[test]
fn quantized_on_load_is_as_close_to_the_float_reference_as_llama_cpps_files() {
    let oracle = |v: &str| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/oracle")
            .join(v)
    };
    for (quant, kind) in [(Quant::Int8, "Q8_0"), (Quant::Q4, "Q4_0")] {
        let mut all = Closeness::default();
        for variant in VARIANTS {
            let golden = golden(variant);
            let policy = LoadPolicy {
                quant,
                ..LoadPolicy::default()
            };
            let model = load(&oracle(variant), policy).expect("load");
            let float = &golden.files["F16"];
            let theirs = &golden.files[kind];
            let mut sums = Closeness::default();
            for ((p, _), raw) in float.prompts().iter().zip(&theirs.prompts) {
                let reference = reference_rows(variant, "F16", &p.name);
                let llama = LlamaCpp::read(&raw["llama_cpp_vs_float"]);
                sums += closeness(
                    &forced_rows(&model, &p.input_ids, &p.greedy.generated_ids),
                    p,
                    &reference,
                    &llama,
                );
            }
            println!("{variant} {} vs {kind}: {sums}", quant.name());
            all += sums;
        }
        println!("{} vs {kind}, all variants: {all}", quant.name());
        assert!(
            all.kl <= ON_LOAD_OVER_LLAMA_CPP * all.llama_cpp_kl,
            "{} vs {kind}: {all} is not within {ON_LOAD_OVER_LLAMA_CPP}x llama.cpp's",
            quant.name()
        );
    }
}
