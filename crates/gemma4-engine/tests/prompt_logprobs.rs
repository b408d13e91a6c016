//! Prompt log-probabilities against the reference: each prompt token's
//! log-probability given those before it equals the log-softmax of the
//! reference's logits at the position before it (the oracle's
//! `prompt{i}.logits`, every position), within the oracle's tolerance, on
//! every variant; through chunked prefill, after the prompt was cached by
//! an earlier request, and with nothing generated (`max_tokens: 0`).

use std::path::PathBuf;
use std::sync::Arc;

use gemma4_engine::{
    start, EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerationRequest,
    SamplingParams, TokenLogprob,
};
use gemma4_model::golden::Golden;
use gemma4_model::load_hf_dir;
use gemma4_text::Tokenizer;
use safetensors::SafeTensors;

const VARIANTS: &[&str] = &["e-style", "dense-k-eq-v", "moe", "unified"];
/// The oracle's logit tolerance (max abs diff 1e-3); a log-probability is a
/// logit minus the log-sum-exp of its row, so it may be off by twice that.
const TOLERANCE: f32 = 2e-3;
const TOP: usize = 3;

fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(variant)
}

fn engine(variant: &str, chunk: usize) -> EngineHandle {
    let dir = fixture(variant);
    let model = load_hf_dir(&dir).expect("model");
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    let config = EngineConfig {
        max_model_len: 256,
        block_size: 4,
        max_batch_tokens: chunk,
        ..Default::default()
    };
    start(model, tokenizer, config).expect("engine")
}

/// The reference's log-softmax rows of prompt `i`, `[n][vocab]`.
fn reference(variant: &str, i: usize, n: usize) -> Vec<Vec<f32>> {
    let bytes =
        std::fs::read(fixture(variant).join("golden_tensors.safetensors")).expect("tensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("safetensors");
    let logits = tensors
        .tensor(&format!("prompt{i}.logits"))
        .expect("prompt logits");
    let values: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let vocab = values.len() / n;
    values
        .chunks(vocab)
        .map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
            let lse = max + sum.ln() as f32;
            row.iter().map(|v| v - lse).collect()
        })
        .collect()
}

/// Runs `prompt` with prompt log-probabilities; returns them, the generated
/// ids and the finish reason.
fn score(
    engine: &EngineHandle,
    prompt: &[u32],
    max_tokens: usize,
) -> (Vec<TokenLogprob>, Vec<u32>, FinishReason) {
    let mut stream = engine
        .submit(GenerationRequest::new(
            prompt.to_vec(),
            SamplingParams {
                max_tokens,
                prompt_logprobs: Some(TOP),
                ..Default::default()
            },
        ))
        .expect("submit");
    let (mut scored, mut ids) = (Vec::new(), Vec::new());
    while let Some(event) = stream.blocking_next() {
        match event {
            EngineEvent::PromptLogprobs(lps) => {
                assert!(ids.is_empty(), "prompt log-probs after a generated token");
                scored.extend(lps);
            }
            EngineEvent::Token { id, .. } => ids.push(id),
            EngineEvent::Finished { reason, .. } => return (scored, ids, reason),
        }
    }
    panic!("the stream ended without Finished");
}

/// Every prompt token after the first, scored as the reference scores it.
fn check(variant: &str, i: usize, prompt: &[u32], scored: &[TokenLogprob]) {
    let reference = reference(variant, i, prompt.len());
    assert_eq!(scored.len(), prompt.len() - 1, "{variant} prompt {i}");
    for (p, lp) in scored.iter().enumerate() {
        let row = &reference[p];
        let token = prompt[p + 1];
        assert_eq!(
            lp.token_id,
            token,
            "{variant} prompt {i} position {}",
            p + 1
        );
        let want = row[token as usize];
        assert!(
            (lp.logprob - want).abs() <= TOLERANCE,
            "{variant} prompt {i} position {}: {} vs the reference's {want}",
            p + 1,
            lp.logprob
        );
        // The rank and the alternatives, wherever the reference's order is clear.
        let clear = |a: f32, b: f32| (a - b).abs() > 2.0 * TOLERANCE;
        if row.iter().all(|&v| v == want || clear(v, want)) {
            let above = row.iter().filter(|&&v| v > want).count();
            assert_eq!(
                lp.rank,
                above + 1,
                "{variant} prompt {i} position {}",
                p + 1
            );
        }
        assert_eq!(lp.top.len(), TOP);
        for (id, _, value) in &lp.top {
            assert!((value - row[*id as usize]).abs() <= TOLERANCE);
        }
        let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!((lp.top[0].2 - best).abs() <= TOLERANCE);
    }
}

#[test]
fn prompt_logprobs_match_the_reference_on_every_variant() {
    for v in VARIANTS {
        let golden = Golden::read(&fixture(v).join("golden.json")).expect("golden");
        // Chunks of 16: the longer prompts are scored across several steps.
        let engine = engine(v, 16);
        for (i, p) in golden.prompts.iter().enumerate() {
            let (scored, ids, reason) = score(&engine, &p.input_ids, 0);
            check(v, i, &p.input_ids, &scored);
            assert!(ids.is_empty(), "max_tokens 0 generated {ids:?}");
            assert_eq!(reason, FinishReason::Length);
        }
        // With generation: the greedy continuation is the reference's.
        let p = &golden.prompts[1];
        let (scored, ids, _) = score(&engine, &p.input_ids, 4);
        check(v, 1, &p.input_ids, &scored);
        assert_eq!(ids, p.greedy.generated_ids[..4]);
    }
}

#[test]
fn a_cached_prompt_is_scored_in_full() {
    let v = "e-style";
    let golden = Golden::read(&fixture(v).join("golden.json")).expect("golden");
    let engine = engine(v, 64);
    let prompt = &golden.prompts[2].input_ids;
    // An earlier request leaves the prompt's blocks in the prefix cache.
    engine
        .submit(GenerationRequest::new(
            prompt.clone(),
            SamplingParams {
                max_tokens: 1,
                ..Default::default()
            },
        ))
        .expect("submit")
        .blocking_finish()
        .expect("finished");
    let (scored, _, _) = score(&engine, prompt, 1);
    check(v, 2, prompt, &scored);
}
