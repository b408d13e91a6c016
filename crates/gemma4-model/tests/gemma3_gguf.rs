//! Real weights: Google's Gemma 3 270M (GGUF, Q4_K_M) against the Hugging
//! Face float32 reference run on the same dequantized weights.
//!
//! The GGUF is large, so it is not a fixture: set `GEMMA4_DEMO_GGUF` to its
//! path (`.ci/run` does). Under CI (`CI` set) a missing file is a failure.

use std::path::PathBuf;

use gemma4_model::golden::{greedy, verify_prompt, Golden, DEFAULT_TOLERANCE};
use gemma4_model::{load, Gemma4, GgufMode};

fn demo_gguf() -> Option<PathBuf> {
    match std::env::var_os("GEMMA4_DEMO_GGUF") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => panic!("CI must set GEMMA4_DEMO_GGUF"),
        None => {
            eprintln!("skipped: set GEMMA4_DEMO_GGUF to the Gemma 3 270M GGUF");
            None
        }
    }
}

fn golden() -> Golden {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/gemma3-270m/golden.json");
    Golden::read(&path).expect("golden")
}

fn model(mode: GgufMode) -> Option<Gemma4> {
    let path = demo_gguf()?;
    Some(load(&path, mode).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

#[test]
fn dequantized_weights_match_the_reference_exactly() {
    let Some(model) = model(GgufMode::Dequantized) else {
        return;
    };
    for p in &golden().prompts {
        let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
        println!(
            "{}: diff {:.2e} first mismatch {:?}",
            p.name, r.max_abs_logit_diff, r.first_token_mismatch
        );
        assert_eq!(r.generated_ids, p.greedy.generated_ids, "{}", p.name);
        assert!(
            r.top5_mismatches.is_empty(),
            "{}: {:?}",
            p.name,
            r.top5_mismatches
        );
    }
    let golden = golden();
    let coherence = golden.coherence.expect("coherence prompts");
    for c in &coherence.prompts {
        assert!(c.generated_text.contains("Paris"));
        let ids = greedy(&model, &c.input_ids, c.generated_ids.len()).expect("greedy");
        assert_eq!(ids, c.generated_ids, "{:?}", c.text);
    }
}

#[test]
fn quantized_kernels_agree_on_the_first_tokens() {
    let Some(model) = model(GgufMode::Quantized) else {
        return;
    };
    for p in &golden().prompts {
        let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
        println!("{}: first mismatch {:?}", p.name, r.first_token_mismatch);
        assert_eq!(
            r.generated_ids[..8],
            p.greedy.generated_ids[..8],
            "{}",
            p.name
        );
    }
    for c in &golden().coherence.expect("coherence prompts").prompts {
        let ids = greedy(&model, &c.input_ids, 8).expect("greedy");
        assert_eq!(ids, c.generated_ids[..8], "{:?}", c.text);
    }
}
