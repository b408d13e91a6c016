//! The engine under injected faults: a model step that panics or fails
//! ends only the request that makes it fail (the rest of its batch is run
//! again without it and goes on unchanged); a panic in the bookkeeping
//! ends every request and is reported by `health`. Token ids the model
//! cannot embed are refused at submission.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gemma4_engine::fault::{Fault, FaultPlan};
use gemma4_engine::{
    start, start_with_fault, EngineConfig, EngineEvent, EngineHandle, FinishReason,
    GenerationRequest, RequestStream, SamplingParams, SubmitError,
};
use gemma4_model::golden::Golden;
use gemma4_model::load_hf_dir;
use gemma4_text::Tokenizer;

/// Not in any golden prompt; the fault strikes steps that hold it.
const TRIGGER: u32 = 511;
const STEPS: usize = 12;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/e-style")
}

fn engine(fault: Option<Fault>) -> EngineHandle {
    let model = load_hf_dir(&fixture()).expect("model");
    let tokenizer = Arc::new(Tokenizer::from_dir(&fixture()).expect("tokenizer"));
    let config = EngineConfig {
        max_num_seqs: 4,
        max_model_len: 256,
        block_size: 4,
        ..Default::default()
    };
    match fault {
        Some(fault) => start_with_fault(
            model,
            tokenizer,
            config,
            FaultPlan {
                trigger_token: TRIGGER,
                fault,
            },
        ),
        None => start(model, tokenizer, config),
    }
    .expect("engine")
}

fn request(ids: &[u32]) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: ids.to_vec(),
        params: SamplingParams {
            max_tokens: STEPS,
            ..Default::default()
        },
        deadline: None,
        soft_prompt: None,
        reading: Default::default(),
        adapter: None,
    }
}

fn finish(stream: RequestStream, mut out: Vec<u32>) -> (Vec<u32>, FinishReason) {
    let (rest, reason) = stream
        .blocking_finish()
        .expect("stream ended without Finished");
    out.extend(rest);
    (out, reason)
}

fn golden_prompt() -> (Vec<u32>, Vec<u32>) {
    let golden = Golden::read(&fixture().join("golden.json")).expect("golden");
    let p = &golden.prompts[0];
    assert!(!p.input_ids.contains(&TRIGGER));
    (p.input_ids.clone(), p.greedy.generated_ids.clone())
}

/// Tokens of the good request: long enough that it is still decoding when
/// the bad one arrives, even on a loaded machine that runs the test thread late.
const GOOD_STEPS: usize = 160;

/// A good request is decoding when a bad one joins its batch.
fn good_and_bad_in_one_batch(engine: &EngineHandle) -> ((Vec<u32>, FinishReason), FinishReason) {
    let (good, _) = golden_prompt();
    let mut long = request(&good);
    long.params.max_tokens = GOOD_STEPS;
    let mut good_stream = engine.submit(long).expect("submit good");
    // Wait for the good request's first token: it is then in every later step.
    let first = match good_stream.blocking_next() {
        Some(EngineEvent::Token { id, .. }) => id,
        other => panic!("expected a token, got {other:?}"),
    };
    let bad = engine
        .submit(request(&[2, 300, TRIGGER, 301]))
        .expect("submit bad");
    let (_, bad_reason) = finish(bad, Vec::new());
    (finish(good_stream, vec![first]), bad_reason)
}

#[test]
fn a_panicking_or_failing_step_ends_only_the_request_that_fails() {
    let (_, reference) = golden_prompt();
    for fault in [Fault::ModelPanics, Fault::ModelFails] {
        let engine = engine(Some(fault));
        let ((good, good_reason), bad_reason) = good_and_bad_in_one_batch(&engine);
        assert!(
            matches!(&bad_reason, FinishReason::Error(m) if m.contains("injected fault")),
            "{fault:?}: bad request ended with {bad_reason:?}"
        );
        assert_eq!(good_reason, FinishReason::Length, "{fault:?}");
        assert_eq!(good.len(), GOOD_STEPS, "{fault:?}");
        assert_eq!(
            good[..reference.len()],
            reference[..],
            "{fault:?}: the good request's output changed"
        );
        assert!(
            engine.stats().step_retries >= 1,
            "{fault:?}: the two requests never shared a failing step"
        );
        assert_eq!(engine.health(), Ok(()), "{fault:?}");
        // The engine goes on serving.
        let (ids, reason) = finish(
            engine.submit(request(&golden_prompt().0)).expect("submit"),
            Vec::new(),
        );
        assert_eq!(
            (ids.as_slice(), reason),
            (&reference[..STEPS], FinishReason::Length)
        );
    }
}

#[test]
fn a_bookkeeping_panic_fails_every_request_and_is_reported() {
    let engine = engine(Some(Fault::BookkeepingPanics));
    let ((_, good_reason), bad_reason) = good_and_bad_in_one_batch(&engine);
    for reason in [&good_reason, &bad_reason] {
        assert!(
            matches!(reason, FinishReason::Error(m) if m.contains("must be restarted")),
            "{reason:?}"
        );
    }
    let why = engine.health().expect_err("the engine reports its failure");
    assert!(why.contains("injected fault: bookkeeping panics"), "{why}");
    assert_eq!(
        engine.submit(request(&[2, 300])).err(),
        Some(SubmitError::Stopped)
    );
    // It stays failed.
    std::thread::sleep(Duration::from_millis(50));
    assert!(engine.health().is_err());
}

#[test]
fn token_ids_the_embedding_lacks_are_refused() {
    // A tokenizer with an added token at id 512, one past the model's embedding rows.
    let dir = std::env::temp_dir().join(format!("gemma4-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(fixture()).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
    }
    let path = dir.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    tok["added_tokens"]
        .as_array_mut()
        .expect("added tokens")
        .push(serde_json::json!({
            "id": 512, "content": "<extra>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(&path, tok.to_string()).expect("write");
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    assert_eq!(tokenizer.vocab_size(), 513);
    let model = load_hf_dir(&dir).expect("model");
    let engine = start(model, tokenizer, EngineConfig::default()).expect("engine");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(engine.limits().token_id_limit, 512);
    match engine.submit(request(&[2, 512, 300])) {
        Err(SubmitError::Invalid(m)) => {
            assert!(m.contains("token id 512") && m.contains("below 512"), "{m}")
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a token id past the embedding was accepted"),
    }
    let mut stop = request(&[2, 300]);
    stop.params.stop_token_ids = vec![512];
    assert!(matches!(engine.submit(stop), Err(SubmitError::Invalid(_))));
}

/// Allows only even token ids; records on which threads it prepared and was
/// asked, and panics when preparing after `panic_after` accepted tokens.
struct EvenTokens {
    mask: Vec<u32>,
    ready: bool,
    accepted: usize,
    panic_after: Option<usize>,
    engine_thread: Arc<std::sync::Mutex<Vec<(std::thread::ThreadId, std::thread::ThreadId)>>>,
    prepared_on: Option<std::thread::ThreadId>,
}

impl gemma4_engine::TokenConstraint for EvenTokens {
    fn prepare(&mut self) {
        if self.panic_after.is_some_and(|n| self.accepted >= n) {
            panic!("a broken grammar");
        }
        self.mask = vec![0x5555_5555; 262_144 / 32];
        self.ready = true;
        self.prepared_on = Some(std::thread::current().id());
    }

    fn allowed(&mut self) -> Option<&[u32]> {
        if !self.ready {
            self.prepare();
        }
        if let (Some(p), Ok(mut seen)) = (self.prepared_on, self.engine_thread.lock()) {
            seen.push((p, std::thread::current().id()));
        }
        Some(&self.mask)
    }

    fn accept(&mut self, _token: u32) {
        self.ready = false;
        self.accepted += 1;
    }
}

fn constrained(
    ids: &[u32],
    panic_after: Option<usize>,
    seen: &Arc<std::sync::Mutex<Vec<(std::thread::ThreadId, std::thread::ThreadId)>>>,
) -> GenerationRequest {
    let seen = seen.clone();
    let factory = gemma4_engine::ConstraintFactory(Arc::new(move || {
        Box::new(EvenTokens {
            mask: Vec::new(),
            ready: false,
            accepted: 0,
            panic_after,
            engine_thread: seen.clone(),
            prepared_on: None,
        }) as Box<dyn gemma4_engine::TokenConstraint>
    }));
    let mut r = request(ids);
    r.params.constraint = Some(factory);
    r
}

/// Masks are prepared away from the engine thread, before the sampler asks;
/// a constraint that panics while preparing ends its own request only, and
/// never lets it sample unconstrained.
#[test]
fn grammar_masks_are_prepared_off_the_engine_thread_and_a_broken_one_fails_alone() {
    let e = engine(None);
    let (prompt, _) = golden_prompt();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let good = e.submit(constrained(&prompt, None, &seen)).expect("submit");
    let broken = e
        .submit(constrained(&prompt, Some(3), &seen))
        .expect("submit");
    let (good_ids, good_reason) = finish(good, Vec::new());
    let (broken_ids, broken_reason) = finish(broken, Vec::new());
    assert_eq!(good_reason, FinishReason::Length);
    assert_eq!(good_ids.len(), STEPS);
    assert!(good_ids.iter().all(|t| t % 2 == 0), "{good_ids:?}");
    assert!(
        matches!(&broken_reason, FinishReason::Error(m) if m.contains("a broken grammar")),
        "{broken_reason:?}"
    );
    assert_eq!(
        broken_ids.len(),
        3,
        "no token after the failure: {broken_ids:?}"
    );
    assert!(broken_ids.iter().all(|t| t % 2 == 0), "{broken_ids:?}");
    let seen = seen.lock().expect("record");
    assert!(!seen.is_empty());
    assert!(
        seen.iter().all(|(prepared, asked)| prepared != asked),
        "every mask was ready before the sampler asked, from another thread"
    );
    assert!(e.health().is_ok());
}
