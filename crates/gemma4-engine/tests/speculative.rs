//! Speculative decoding against plain decoding on the oracle fixtures:
//! drafts verified in the normal step never change what is generated,
//! greedy (the reference's own continuations) or seeded sampling, solo or
//! batched, whole or chunked, with the limits of a request held.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gemma4_engine::speculative::MAX_SPECULATIVE_TOKENS;
use gemma4_engine::{
    EngineConfig, EngineHandle, EngineStats, FinishReason, GenerationRequest, SamplingParams,
    SpeculativeConfig,
};
use gemma4_model::golden::{greedy, Golden};
use gemma4_model::Gemma4;
use gemma4_text::Tokenizer;

mod support;
use support::{oracle_fixture, oracle_model, oracle_tokenizer, run_request, start_on, Seam, SEAMS};

const VARIANTS: &[&str] = &["e-style", "dense-k-eq-v", "moe", "unified"];
const STEPS: usize = 32;

/// The golden prompts, and two whose text repeats (so lookups match
/// before the output does).
fn prompts(variant: &str) -> Vec<Vec<u32>> {
    let golden = Golden::read(&oracle_fixture(variant).join("golden.json")).expect("golden");
    let mut out: Vec<Vec<u32>> = golden.prompts.iter().map(|p| p.input_ids.clone()).collect();
    let phrase: Vec<u32> = (0..9).map(|i| 120 + (i * 53) % 370).collect();
    out.push([&[2], &phrase[..], &[300], &phrase[..4]].concat());
    out.push([&[2], &phrase[..], &phrase[..], &phrase[..], &phrase[..2]].concat());
    out
}

fn engine(variant: &str, seam: Seam, chunk: usize, speculative: bool) -> EngineHandle {
    engine_drafting(variant, seam, chunk, speculative.then_some(4))
}

/// An engine drafting up to `drafts` tokens a step, if any.
fn engine_drafting(variant: &str, seam: Seam, chunk: usize, drafts: Option<usize>) -> EngineHandle {
    let config = EngineConfig {
        max_num_seqs: 8,
        max_queue: 16,
        max_model_len: 256,
        block_size: 4,
        max_batch_tokens: chunk,
        speculative: drafts.map(|k| SpeculativeConfig::ngram(1, 3, k).expect("settings")),
        ..Default::default()
    };
    start_on(
        seam,
        oracle_model(variant),
        oracle_tokenizer(variant),
        config,
    )
}

fn run(engine: &EngineHandle, ids: &[u32], params: SamplingParams) -> (Vec<u32>, FinishReason) {
    run_request(engine, ids, params)
}

fn greedy_params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..Default::default()
    }
}

/// Every prompt at once, staggered; outputs in prompt order.
fn run_concurrently(engine: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| {
                let engine = engine.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(3 * i as u64));
                    run(&engine, ids, greedy_params(STEPS)).0
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    })
}

fn wait_idle(engine: &EngineHandle) -> EngineStats {
    for _ in 0..2000 {
        let s = engine.stats();
        if s.running == 0 && s.kv_blocks_used == 0 && s.executor_requests == 0 {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.stats()
}

/// Greedy output with drafts is the solo reference run's, token for token
/// (the golden prompts' runs are the reference's own continuations), on
/// every variant, batched and solo, in whole and chunked steps, through
/// both sides of the seam; drafts were both accepted and rejected.
#[test]
fn drafts_leave_greedy_output_unchanged() {
    for v in VARIANTS {
        let golden = Golden::read(&oracle_fixture(v).join("golden.json")).expect("golden");
        let prompts = prompts(v);
        let solo_model = oracle_model(v);
        let reference: Vec<Vec<u32>> = prompts
            .iter()
            .map(|ids| greedy(&solo_model, ids, STEPS).expect("solo"))
            .collect();
        for (p, r) in golden.prompts.iter().zip(&reference) {
            let n = p.greedy.generated_ids.len();
            assert_eq!(r[..n], p.greedy.generated_ids, "{v}: solo run departs");
        }
        let configs = [
            (4096, Seam::Direct, 4),
            (7, Seam::Threaded, 4),
            (3, Seam::Direct, 4),
            (4096, Seam::Threaded, MAX_SPECULATIVE_TOKENS),
        ];
        for (chunk, seam, k) in configs {
            let engine = engine_drafting(v, seam, chunk, Some(k));
            let outs = run_concurrently(&engine, &prompts);
            for (i, (o, r)) in outs.iter().zip(&reference).enumerate() {
                assert_eq!(o, r, "{v} chunk {chunk} {seam:?} prompt {i} batched");
            }
            for (i, ids) in prompts.iter().enumerate() {
                let (out, _) = run(&engine, ids, greedy_params(STEPS));
                assert_eq!(
                    out, reference[i],
                    "{v} chunk {chunk} {seam:?} prompt {i} solo"
                );
            }
            let stats = wait_idle(&engine);
            assert_eq!(stats.kv_blocks_used, 0, "{v}: blocks leaked");
            let s = stats.speculation;
            assert!(
                s.accepted_tokens > 0,
                "{v} chunk {chunk}: nothing accepted: {s:?}"
            );
            assert!(
                s.draft_tokens > s.accepted_tokens,
                "{v} chunk {chunk}: nothing rejected: {s:?}"
            );
        }
    }
}

/// `max_tokens`, the context's end and stop tokens cut an accepted run
/// where plain decoding would stop.
#[test]
fn drafts_keep_to_the_requests_limits() {
    let v = "dense-k-eq-v";
    let prompts = prompts(v);
    let solo_model = oracle_model(v);
    for seam in SEAMS {
        limits_hold(v, &prompts, &solo_model, &engine(v, seam, 4096, true));
    }
}

fn limits_hold(v: &str, prompts: &[Vec<u32>], solo_model: &Gemma4, engine: &EngineHandle) {
    let mut stopped = 0;
    for ids in prompts {
        let reference = greedy(solo_model, ids, STEPS).expect("solo");
        for max_tokens in [1, 2, 5, 9] {
            let (out, reason) = run(engine, ids, greedy_params(max_tokens));
            assert_eq!(out, reference[..max_tokens], "{v} max_tokens {max_tokens}");
            assert_eq!(reason, FinishReason::Length);
        }
        // A stop token first generated after a run of repeats ends it there.
        let Some(at) = (1..reference.len()).find(|&i| !reference[..i].contains(&reference[i]))
        else {
            continue;
        };
        stopped += 1;
        let params = SamplingParams {
            stop_token_ids: vec![reference[at]],
            ..greedy_params(STEPS)
        };
        let (out, reason) = run(engine, ids, params);
        assert_eq!(
            (out.as_slice(), reason),
            (&reference[..at], FinishReason::Stop)
        );
    }
    assert!(stopped >= 3, "{v}: too few outputs change token");
    // To the context's end: 256 positions.
    let ids = &prompts[3];
    let room = 256 - ids.len();
    let reference = greedy(solo_model, ids, room).expect("solo");
    let (out, reason) = run(engine, ids, greedy_params(room));
    assert_eq!((out, reason), (reference, FinishReason::Length));
    assert_eq!(wait_idle(engine).kv_blocks_used, 0);
}

/// A seeded request samples the same tokens with drafts as without: each
/// token is drawn from its own position's distribution in the same order,
/// and a draft is kept exactly when the sampler draws it.
#[test]
fn seeded_sampling_is_unchanged_by_drafts() {
    let v = "moe";
    let prompts = prompts(v);
    let plain = engine(v, Seam::Direct, 64, false);
    let drafted = engine(v, Seam::Direct, 64, true);
    for seed in 0..6u64 {
        for ids in &prompts {
            let params = SamplingParams {
                temperature: 0.7,
                top_k: 40,
                seed: Some(seed),
                repetition_penalty: 1.1,
                ..greedy_params(STEPS)
            };
            let a = run(&plain, ids, params.clone());
            let b = run(&drafted, ids, params);
            assert_eq!(a, b, "seed {seed}");
        }
    }
    let s = wait_idle(&drafted).speculation;
    assert!(
        s.accepted_tokens > 0 && s.draft_tokens > s.accepted_tokens,
        "{s:?}"
    );
    assert_eq!(wait_idle(&plain).speculation.draft_tokens, 0);
}

/// Speculation settings out of range are refused by name.
#[test]
fn speculation_settings_out_of_range_are_refused() {
    let e = SpeculativeConfig::ngram(1, 3, 99).expect_err("99 tokens");
    assert!(e.to_string().contains("from 1 to 7"), "{e}");
    let e = SpeculativeConfig::ngram(3, 2, 4).expect_err("min above max");
    assert!(e.to_string().contains("min 3, max 2"), "{e}");
}

/// A request may decode plainly on an engine that drafts; the counts of
/// its usage say which way each request went.
#[test]
fn a_request_can_turn_drafting_off() {
    let v = "dense-k-eq-v";
    let engine = engine(v, Seam::Direct, 4096, true);
    let ids = &prompts(v)[0];
    let usage = |plain_decoding: bool| {
        let mut stream = engine
            .submit(GenerationRequest {
                prompt_ids: ids.clone(),
                params: SamplingParams {
                    plain_decoding,
                    ..greedy_params(STEPS)
                },
                deadline: None,
                soft_prompt: None,
                reading: Default::default(),
                adapter: None,
            })
            .expect("submit");
        let mut tokens = 0;
        loop {
            match stream.blocking_next().expect("event") {
                gemma4_engine::EngineEvent::Token { .. } => tokens += 1,
                gemma4_engine::EngineEvent::Finished { usage, .. } => break (tokens, usage),
                gemma4_engine::EngineEvent::PromptLogprobs(_) => {}
            }
        }
    };
    let (n, drafted) = usage(false);
    assert_eq!(n, STEPS);
    assert!(drafted.speculation.accepted_tokens > 0, "{drafted:?}");
    assert_eq!(drafted.completion_tokens, STEPS);
    let (n, plain) = usage(true);
    assert_eq!(n, STEPS);
    assert_eq!(plain.speculation, Default::default());
}

/// Real weights (Google's Gemma 3 270M, the demo GGUF). Exact mode with
/// drafts keeps every token of the float32 reference on the golden prompts
/// and the coherence prompt (" Paris" among them); the default mode (8-bit
/// activations) gives with drafts what it gives without on the committed
/// copy-heavy prompts, all at once, and drafts are accepted.
#[test]
fn real_weights_keep_the_reference_with_drafts() {
    let Some(path) = gemma4_model::golden::demo_gguf_for_tests() else {
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let golden =
        Golden::read(&root.join("tests/fixtures/oracle/gemma3-270m/golden.json")).expect("golden");
    let exact = gemma4_model::LoadPolicy {
        exact: true,
        ..Default::default()
    };
    let start = |policy| {
        let model = gemma4_model::load(&path, policy).expect("demo model");
        let tokenizer = Arc::new(Tokenizer::from_gguf(&path).expect("tokenizer"));
        // No prefix cache: a request that adopts another's prompt blocks
        // computes the rest of its prompt in a shorter chunk, whose products
        // round differently in the default mode; each run here computes
        // its prompt alike.
        let config = EngineConfig {
            max_model_len: 512,
            prefix_caching: false,
            speculative: Some(SpeculativeConfig::ngram(2, 4, 4).expect("settings")),
            ..Default::default()
        };
        gemma4_engine::start(model, tokenizer, config).expect("engine")
    };
    let engine = start(exact);
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
    for (prompt, want) in cases {
        let (out, _) = run(&engine, &prompt, greedy_params(want.len()));
        assert_eq!(out, want, "exact mode with drafts left the reference");
    }
    drop(engine);
    let engine = start(Default::default());
    let tokenizer = Tokenizer::from_gguf(&path).expect("tokenizer");
    let lines =
        std::fs::read_to_string(root.join("benches/speculative/prompts.jsonl")).expect("prompts");
    let prompts: Vec<Vec<u32>> = lines
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("prompt line"))
        .filter(|p| p["kind"] == "copy")
        .map(|p| {
            tokenizer
                .encode(p["prompt"].as_str().expect("text"), true)
                .expect("ids")
        })
        .collect();
    // One request at a time: in the default (8-bit activation) mode a
    // decode row that shares its step with another request's prompt chunk
    // goes through the prompt's product, which rounds differently, so only
    // a request's own rows may share its steps here.
    let both: Vec<(Vec<u32>, Vec<u32>)> = prompts
        .iter()
        .map(|ids| {
            let plain = SamplingParams {
                plain_decoding: true,
                ..greedy_params(64)
            };
            let a = run(&engine, ids, greedy_params(64)).0;
            let b = run(&engine, ids, plain).0;
            (a, b)
        })
        .collect();
    for (i, (drafted, plain)) in both.iter().enumerate() {
        assert_eq!(drafted, plain, "copy prompt {i}");
    }
    let s = wait_idle(&engine).speculation;
    assert!(s.accepted_tokens * 2 > s.draft_tokens, "{s:?}");
}

/// Bans the token last accepted: a mask that changes with every token, as
/// a grammar's does.
struct NoRepeat {
    words: usize,
    last: Option<u32>,
    mask: Vec<u32>,
}

impl gemma4_engine::TokenConstraint for NoRepeat {
    fn allowed(&mut self) -> Option<&[u32]> {
        self.mask = vec![u32::MAX; self.words];
        if let Some(t) = self.last {
            self.mask[t as usize / 32] &= !(1 << (t % 32));
        }
        Some(&self.mask)
    }

    fn accept(&mut self, token: u32) {
        self.last = Some(token);
    }
}

/// Under a constraint whose mask follows each accepted token, drafted
/// output is the output without drafts: each verified position is masked
/// as it would be in its own step.
#[test]
fn drafts_keep_a_constraint_that_changes_with_every_token() {
    let v = "moe";
    let vocab = oracle_model(v).config().vocab_size;
    let constraint = gemma4_engine::ConstraintFactory(Arc::new(move || {
        Box::new(NoRepeat {
            words: vocab.div_ceil(32),
            last: None,
            mask: Vec::new(),
        }) as Box<dyn gemma4_engine::TokenConstraint>
    }));
    let plain = engine(v, Seam::Direct, 64, false);
    let drafted = engine(v, Seam::Threaded, 64, true);
    for ids in prompts(v) {
        let params = SamplingParams {
            constraint: Some(constraint.clone()),
            ..greedy_params(STEPS)
        };
        let a = run(&plain, &ids, params.clone()).0;
        assert!(a.windows(2).all(|w| w[0] != w[1]), "the mask holds: {a:?}");
        assert_eq!(a, run(&drafted, &ids, params).0);
    }
    let s = wait_idle(&drafted).speculation;
    assert!(s.accepted_tokens > 0, "{s:?}");
}
