//! Real weights through the engine with each KV-pool type: Google's Gemma 3
//! 270M (GGUF, Q4_K_M, with f32 activations) against the Hugging Face
//! float32 reference run on the same dequantized weights. f32 pools keep
//! every reference token; bf16 and int8 pools must still answer " Paris"
//! (the 7th reference token of the coherence prompt) and may leave the
//! reference on any prompt only where its own top two logits are within
//! [`NEAR_TIE`] (`tests/fixtures/llamacpp/demo/steps.json` records its
//! margin at every step). Prints the counts docs/quantization.md reports.
//!
//! Set `GEMMA4_DEMO_GGUF` to the GGUF (`.ci/run` does); under CI a missing
//! file is a failure.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gemma4_engine::{start, EngineConfig, GenerationRequest, SamplingParams};
use gemma4_model::golden::{demo_gguf_for_tests as demo_gguf, Golden};
use gemma4_model::paged::KvDtype;
use gemma4_model::{load, LoadPolicy};
use gemma4_text::Tokenizer;

/// For every golden prompt and then the coherence prompt: the leading
/// reference tokens a greedy run through the engine keeps, and how many the
/// reference has.
fn leading_tokens(path: &Path, dtype: KvDtype) -> Vec<(usize, usize)> {
    let policy = LoadPolicy {
        exact: true,
        ..LoadPolicy::default()
    };
    let model = load(path, policy).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tokenizer = Tokenizer::from_gguf(path).expect("tokenizer");
    let engine = start(
        model,
        Arc::new(tokenizer),
        EngineConfig {
            max_model_len: 256,
            kv_dtype: dtype,
            ..Default::default()
        },
    )
    .expect("engine");
    let golden = Golden::read(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/oracle/gemma3-270m/golden.json"),
    )
    .expect("golden");
    let coherence = golden.coherence.expect("coherence prompts").prompts;
    let cases = golden
        .prompts
        .iter()
        .map(|p| (p.input_ids.clone(), p.greedy.generated_ids.clone()))
        .chain(
            coherence
                .iter()
                .map(|c| (c.input_ids.clone(), c.generated_ids.clone())),
        );
    cases
        .map(|(prompt, want)| {
            let (out, _) = engine
                .submit(GenerationRequest {
                    prompt_ids: prompt,
                    params: SamplingParams {
                        max_tokens: want.len(),
                        ..Default::default()
                    },
                    deadline: None,
                    soft_prompt: None,
                    reading: Default::default(),
                    adapter: None,
                })
                .expect("submit")
                .blocking_finish()
                .expect("stream ended without Finished");
            let kept = out.iter().zip(&want).take_while(|(a, b)| a == b).count();
            (kept, want.len())
        })
        .collect()
}

/// A reference top-2 margin under which a lossy KV pool may change the
/// choice, as the oracle tests allow (docs/quantization.md).
const NEAR_TIE: f32 = 0.25;

/// The reference's top-1 − top-2 margin at each greedy step, per prompt in
/// the order [`leading_tokens`] runs them (the golden prompts, then the
/// coherence prompt).
fn reference_margins() -> Vec<Vec<f32>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llamacpp/demo/steps.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let steps: serde_json::Value = serde_json::from_str(&text).expect("steps.json");
    steps["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| serde_json::from_value(p["step_top1_top2_margin"].clone()).expect("margins"))
        .collect()
}

#[test]
fn every_kv_pool_type_says_paris_and_f32_keeps_the_reference() {
    let Some(path) = demo_gguf() else {
        return;
    };
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Int8] {
        let kept = leading_tokens(&path, dtype);
        let shown: Vec<String> = kept.iter().map(|(k, n)| format!("{k}/{n}")).collect();
        println!(
            "{} KV: leading reference tokens {}",
            dtype.name(),
            shown.join(", ")
        );
        let (paris, _) = *kept.last().expect("coherence prompt");
        assert!(
            paris >= 7,
            "{} KV lost \" Paris\": {}",
            dtype.name(),
            shown.join(", ")
        );
        for ((k, n), m) in kept.iter().zip(reference_margins()) {
            assert!(
                k == n || m[*k] < NEAR_TIE,
                "{} KV left the reference at step {k}, where its margin is {}: {}",
                dtype.name(),
                m[*k],
                shown.join(", ")
            );
        }
        if dtype == KvDtype::F32 {
            assert!(
                kept.iter().all(|(k, n)| k == n),
                "f32 KV left the reference: {}",
                shown.join(", ")
            );
        }
    }
}
