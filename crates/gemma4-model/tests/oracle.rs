//! The forward pass against the Hugging Face float32 reference, on every
//! tiny checkpoint in `tests/fixtures/oracle`.

use std::path::PathBuf;

use gemma4_model::golden::{argmax, verify_prompt, Golden, DEFAULT_TOLERANCE};
use gemma4_model::{load_hf_dir, Gemma4, LogitsFor};

const VARIANTS: &[&str] = &["e-style", "dense-k-eq-v", "moe", "unified"];

fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(variant)
}

fn load(variant: &str) -> (Gemma4, Golden) {
    let dir = fixture(variant);
    let model = load_hf_dir(&dir).unwrap_or_else(|e| panic!("{variant}: {e}"));
    let golden = Golden::read(&dir.join("golden.json")).expect("golden");
    (model, golden)
}

#[test]
fn every_fixture_matches_the_reference() {
    for v in VARIANTS {
        let (model, golden) = load(v);
        assert_eq!(golden.prompts.len(), 3);
        for p in &golden.prompts {
            let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
            println!(
                "{v}/{}: max_abs_logit_diff={:.2e} match={}",
                p.name, r.max_abs_logit_diff, r.seq_match
            );
            assert!(
                r.max_abs_logit_diff <= DEFAULT_TOLERANCE,
                "{v}/{}: logits off by {}",
                p.name,
                r.max_abs_logit_diff
            );
            assert!(
                r.top5_mismatches.is_empty(),
                "{v}/{}: top-5 differs at {:?}",
                p.name,
                r.top5_mismatches
            );
            assert_eq!(
                r.generated_ids, p.greedy.generated_ids,
                "{v}/{}: greedy continuation",
                p.name
            );
            assert!(r.seq_match);
        }
    }
}

/// The last-position logits of the full prompt, compared value by value.
#[test]
fn last_position_logits_within_tolerance() {
    for v in VARIANTS {
        let (model, golden) = load(v);
        for p in &golden.prompts {
            let mut cache = model.new_cache();
            let logits = model
                .forward(&p.input_ids, &mut cache, LogitsFor::Last, None)
                .expect("forward");
            let ours = logits
                .squeeze(0)
                .expect("row")
                .to_vec1::<f32>()
                .expect("vec");
            let gold = p.last_logits.as_ref().expect("last_logits");
            let diff = ours
                .iter()
                .zip(gold)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= DEFAULT_TOLERANCE, "{v}/{}: {diff}", p.name);
        }
    }
}

/// Feeding the prompt one token at a time through the cache gives the same
/// logits and continuation as one prefill.
#[test]
fn token_by_token_prefill_equals_one_shot() {
    for v in VARIANTS {
        let (model, golden) = load(v);
        for p in &golden.prompts {
            let mut one_shot = model.new_cache();
            let full = model
                .forward(&p.input_ids, &mut one_shot, LogitsFor::All, None)
                .expect("forward");
            let full = full.to_vec2::<f32>().expect("rows");
            let mut stepwise = model.new_cache();
            let mut last = Vec::new();
            for (i, &id) in p.input_ids.iter().enumerate() {
                let row = model
                    .forward(&[id], &mut stepwise, LogitsFor::Last, None)
                    .expect("step");
                last = row.squeeze(0).expect("row").to_vec1::<f32>().expect("vec");
                let diff = last
                    .iter()
                    .zip(&full[i])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 1e-4, "{v}/{} position {i}: {diff}", p.name);
            }
            // Continue greedily from the token-by-token cache.
            let mut ids = Vec::new();
            for _ in 0..p.greedy.generated_ids.len() {
                let (next, _) = argmax(&last);
                ids.push(next);
                let row = model
                    .forward(&[next], &mut stepwise, LogitsFor::Last, None)
                    .expect("decode");
                last = row.squeeze(0).expect("row").to_vec1::<f32>().expect("vec");
            }
            assert_eq!(ids, p.greedy.generated_ids, "{v}/{}", p.name);
        }
    }
}

/// The `long` prompt is several sliding windows long, so the window bound matters.
#[test]
fn long_prompt_exceeds_the_sliding_window() {
    for v in VARIANTS {
        let (model, golden) = load(v);
        let long = golden
            .prompts
            .iter()
            .find(|p| p.name == "long")
            .expect("long prompt");
        assert!(long.input_ids.len() > 2 * model.config().sliding_window);
        let r = verify_prompt(&model, long, DEFAULT_TOLERANCE).expect("verify");
        assert!(r.seq_match, "{v}: {:?}", r);
    }
}

/// A compressed-tensors int4 copy of the e-style fixture (packed by the
/// library itself, `tools/make_compressed_fixture.py`; goldens from
/// transformers on the weights it unpacks) loads as stored, without
/// widening, and matches the reference with f32 activations.
#[test]
fn compressed_tensors_int4_matches_the_reference() {
    let dir = fixture("e-style-int4-ct");
    let policy = gemma4_model::LoadPolicy {
        exact: true,
        ..Default::default()
    };
    let loaded = gemma4_model::load_with(&dir, policy, None).expect("load");
    // Every linear layer but the eight 16-wide per-layer projections (the
    // library cannot group them by 32, so they stay bf16).
    let packed = loaded
        .report
        .by_storage
        .get(gemma4_model::loader::PACKED_INT4)
        .map(|(n, _)| *n);
    assert_eq!(packed, Some(59), "{:?}", loaded.report.by_storage);
    let golden = Golden::read(&dir.join("golden.json")).expect("golden");
    for p in &golden.prompts {
        let r = verify_prompt(&loaded.model, p, DEFAULT_TOLERANCE).expect("verify");
        println!(
            "int4 (compressed-tensors)/{}: max_abs_logit_diff={:.2e}",
            p.name, r.max_abs_logit_diff
        );
        assert!(
            r.max_abs_logit_diff <= DEFAULT_TOLERANCE && r.top5_mismatches.is_empty(),
            "{}: logits off by {}, top-5 differs at {:?}",
            p.name,
            r.max_abs_logit_diff,
            r.top5_mismatches
        );
        assert_eq!(r.generated_ids, p.greedy.generated_ids, "{}", p.name);
    }
}
