//! The engine against solo runs: batching, chunked prefill, prefix reuse,
//! preemption and the sliding-window cache bound, on the oracle fixtures.

use std::time::Duration;

use gemma4_engine::{
    start, EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerationRequest, SamplingParams,
};
use gemma4_model::golden::{greedy, Golden};
use gemma4_model::safetensors_store::SafetensorsStore;

mod support;
use support::{oracle_fixture, oracle_model, oracle_tokenizer, start_on, SEAMS};

const VARIANTS: &[&str] = &["e-style", "dense-k-eq-v", "moe", "unified"];
const STEPS: usize = 24;

/// The three golden prompts (with the reference's own continuations) and
/// five more, two of which share a long prefix with a golden prompt.
fn prompts(variant: &str) -> Vec<(Vec<u32>, Option<Vec<u32>>)> {
    let golden = Golden::read(&oracle_fixture(variant).join("golden.json")).expect("golden");
    let mut out: Vec<(Vec<u32>, Option<Vec<u32>>)> = golden
        .prompts
        .iter()
        .map(|p| (p.input_ids.clone(), Some(p.greedy.generated_ids.clone())))
        .collect();
    let long = golden.prompts[2].input_ids.clone();
    out.push((long[..40].to_vec(), None));
    out.push(([&long[..70], &[400, 401, 402]].concat(), None));
    for seed in 0..3u32 {
        let ids: Vec<u32> = std::iter::once(2)
            .chain((0..(11 + seed * 9)).map(|i| 114 + (i * 37 + seed * 101) % 390))
            .collect();
        out.push((ids, None));
    }
    out
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

fn collect(engine: &EngineHandle, ids: &[u32]) -> (Vec<u32>, FinishReason) {
    engine
        .submit(request(ids))
        .expect("submit")
        .blocking_finish()
        .expect("stream ended without Finished")
}

/// Runs every prompt concurrently with staggered arrivals; returns outputs in prompt order.
fn run_concurrently(
    engine: &EngineHandle,
    prompts: &[(Vec<u32>, Option<Vec<u32>>)],
) -> Vec<Vec<u32>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, (ids, _))| {
                let engine = engine.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(3 * i as u64));
                    collect(&engine, ids)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (ids, reason) = h.join().expect("thread");
                assert_eq!(reason, FinishReason::Length);
                ids
            })
            .collect()
    })
}

fn config(chunk: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 8,
        max_queue: 16,
        max_model_len: 256,
        block_size: 4,
        max_batch_tokens: chunk,
        ..Default::default()
    }
}

#[test]
fn batched_chunked_runs_equal_solo_runs() {
    for v in VARIANTS {
        let prompts = prompts(v);
        let solo_model = oracle_model(v);
        let solo: Vec<Vec<u32>> = prompts
            .iter()
            .map(|(ids, reference)| {
                let out = greedy(&solo_model, ids, STEPS).expect("solo");
                if let Some(r) = reference {
                    assert_eq!(&out, r, "{v}: solo run differs from the reference");
                }
                out
            })
            .collect();
        for (chunk, seam) in [1, 7, 4096].into_iter().flat_map(|c| SEAMS.map(|s| (c, s))) {
            let engine = start_on(seam, oracle_model(v), oracle_tokenizer(v), config(chunk));
            let outs = run_concurrently(&engine, &prompts);
            for (i, (o, s)) in outs.iter().zip(&solo).enumerate() {
                assert_eq!(o, s, "{v} chunk {chunk} {seam:?} prompt {i}");
            }
            // One after another, too: no request sees another's KV.
            for (i, (ids, _)) in prompts.iter().enumerate().rev() {
                assert_eq!(
                    collect(&engine, ids).0,
                    solo[i],
                    "{v} sequential prompt {i}"
                );
            }
            let stats = wait_idle(&engine);
            assert_eq!(stats.kv_blocks_used, 0, "{v}: blocks leaked");
            assert!(
                stats.prefix_cache_hits > 0,
                "{v}: shared prefixes were not reused"
            );
        }
    }
}

fn wait_idle(engine: &EngineHandle) -> gemma4_engine::EngineStats {
    for _ in 0..2000 {
        let s = engine.stats();
        if s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0 && s.executor_requests == 0 {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.stats()
}

#[test]
fn a_tiny_cache_preempts_and_still_gives_solo_outputs() {
    let v = "dense-k-eq-v";
    let prompts = prompts(v);
    let solo_model = oracle_model(v);
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|(ids, _)| greedy(&solo_model, ids, STEPS).expect("solo"))
        .collect();
    // A budget below one sequence's worth: the engine sizes the cache for
    // exactly one full-length (128-token) sequence.
    let cfg = EngineConfig {
        kv_memory_bytes: Some(1),
        max_model_len: 128,
        ..config(64)
    };
    for seam in SEAMS {
        let engine = start_on(seam, oracle_model(v), oracle_tokenizer(v), cfg.clone());
        let outs = run_concurrently(&engine, &prompts);
        assert_eq!(outs, solo, "{seam:?}");
        let stats = wait_idle(&engine);
        assert!(
            stats.preemptions > 0,
            "the cache was not small enough to preempt"
        );
        assert_eq!(stats.kv_blocks_used, 0);
    }
}

#[test]
fn sliding_layers_hold_only_their_window() {
    let v = "e-style";
    let engine = start(
        oracle_model(v),
        oracle_tokenizer(v),
        EngineConfig {
            max_model_len: 2100,
            block_size: 4,
            ..config(512)
        },
    )
    .expect("engine");
    let window = 8usize;
    let mut stream = engine
        .submit(GenerationRequest {
            prompt_ids: vec![2, 379, 399, 473],
            params: SamplingParams {
                max_tokens: 2000,
                ..Default::default()
            },
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .expect("submit");
    let mut n = 0;
    let mut full_seen = Vec::new();
    while let Some(e) = stream.blocking_next() {
        match e {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { .. } => {
                n += 1;
                if n % 500 == 0 && n < 2000 {
                    full_seen.push(engine.stats().kv_full_blocks_used);
                }
            }
            EngineEvent::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Length);
                break;
            }
        }
    }
    assert_eq!(n, 2000);
    let stats = engine.stats();
    assert!(
        stats.kv_sliding_blocks_per_seq_peak <= window.div_ceil(4) + 1,
        "{stats:?}"
    );
    assert!(
        stats.kv_sliding_blocks_per_seq_peak >= window.div_ceil(4),
        "{stats:?}"
    );
    assert!(
        full_seen.windows(2).all(|w| w[1] > w[0]),
        "full group must grow: {full_seen:?}"
    );
}

/// The engine allocates exactly the per-token KV that `gemma4 plan` reports.
#[test]
fn engine_allocation_matches_the_plan() {
    for v in VARIANTS {
        let m = oracle_model(v);
        let plan: Vec<usize> =
            gemma4_model::plan::kv_bytes_per_token(m.config(), gemma4_model::paged::KvDtype::F32)
                .into_iter()
                .map(|(_, b)| b)
                .collect();
        let engine = start(m, oracle_tokenizer(v), config(64)).expect("engine");
        let report = engine.kv_plan();
        let allocated: Vec<usize> = report.groups.iter().map(|g| g.2).collect();
        assert_eq!(allocated, plan, "{v}");
        let total: usize = report
            .groups
            .iter()
            .map(|g| g.2 * g.3 * report.block_size)
            .sum();
        assert_eq!(total, report.total_bytes, "{v}");
    }
}

fn sampled(engine: &EngineHandle, ids: &[u32], seed: u64) -> Vec<u32> {
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(seed),
        max_tokens: 16,
        ..Default::default()
    };
    support::run_request(engine, ids, params).0
}

/// A seeded request samples the same tokens alone and amid other requests.
#[test]
fn seeded_sampling_is_independent_of_the_batch() {
    let v = "moe";
    let engine = start(oracle_model(v), oracle_tokenizer(v), config(64)).expect("engine");
    let prompts = prompts(v);
    let alone = sampled(&engine, &prompts[0].0, 1234);
    assert_eq!(alone.len(), 16);
    let busy = std::thread::scope(|s| {
        let others: Vec<_> = prompts[1..]
            .iter()
            .enumerate()
            .map(|(i, (ids, _))| {
                let engine = engine.clone();
                s.spawn(move || sampled(&engine, ids, i as u64))
            })
            .collect();
        let mine = sampled(&engine, &prompts[0].0, 1234);
        for h in others {
            h.join().expect("thread");
        }
        mine
    });
    assert_eq!(alone, busy);
    assert_ne!(
        alone,
        sampled(&engine, &prompts[0].0, 99),
        "another seed should differ"
    );
}

/// A stop string ends the request and its text is not returned.
#[test]
fn stop_strings_cut_the_text() {
    let v = "e-style";
    let engine = start(oracle_model(v), oracle_tokenizer(v), config(64)).expect("engine");
    let golden = Golden::read(&oracle_fixture(v).join("golden.json")).expect("golden");
    let p = &golden.prompts[2];
    // Find the full text first (and each token's share), then stop on a piece of it.
    let (full, pieces) = {
        let mut s = engine.submit(request(&p.input_ids)).expect("submit");
        let (mut text, mut pieces) = (String::new(), Vec::new());
        while let Some(e) = s.blocking_next() {
            match e {
                EngineEvent::PromptLogprobs(_) => {}
                EngineEvent::Token { text: t, .. } => {
                    text.push_str(&t);
                    pieces.push(t);
                }
                EngineEvent::Finished { text: t, .. } => {
                    text.push_str(&t);
                    break;
                }
            }
        }
        (text, pieces)
    };
    let visible: Vec<(usize, char)> = full
        .char_indices()
        .filter(|(_, c)| c.is_alphanumeric())
        .collect();
    assert!(visible.len() > 4, "need some text to stop on: {full:?}");
    let (at, _) = visible[visible.len() / 2];
    let stop: String = full[at..].chars().take(2).collect();
    let cut = full.find(&stop).expect("stop occurs");
    let params = SamplingParams {
        max_tokens: STEPS,
        stop_strings: vec![stop.clone()],
        ..Default::default()
    };
    let mut s = engine
        .submit(GenerationRequest {
            prompt_ids: p.input_ids.clone(),
            params,
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .expect("submit");
    let (mut text, mut tokens) = (String::new(), 0);
    let usage = loop {
        match s.blocking_next().expect("event") {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { text: t, .. } => {
                text.push_str(&t);
                tokens += 1;
            }
            EngineEvent::Finished {
                text: t,
                reason,
                usage,
                ..
            } => {
                text.push_str(&t);
                assert_eq!(reason, FinishReason::StopString(stop.clone()));
                break usage;
            }
        }
    };
    assert_eq!(text, full[..cut], "stop {stop:?}");
    // The match is found off the model's thread, a step or more after the
    // token that completed it; nothing past that token is sent or counted.
    let mut seen = String::new();
    let completing = pieces
        .iter()
        .position(|t| {
            seen.push_str(t);
            seen.contains(&stop)
        })
        .expect("the stop string completes at some token");
    assert_eq!(tokens, completing + 1, "tokens sent after the stop");
    assert_eq!(usage.completion_tokens, completing + 1);
    assert_eq!(usage.prompt_tokens, p.input_ids.len());
}

/// Deadlines and dropped streams end requests and free their blocks at once.
#[test]
fn timeouts_and_cancellation_free_blocks() {
    let v = "dense-k-eq-v";
    let engine = start(oracle_model(v), oracle_tokenizer(v), config(64)).expect("engine");
    let long = prompts(v)[2].0.clone();
    let params = SamplingParams {
        max_tokens: 100,
        ..Default::default()
    };
    let deadline = Some(std::time::Instant::now());
    let mut s = engine
        .submit(GenerationRequest {
            prompt_ids: long.clone(),
            params: params.clone(),
            deadline,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .expect("submit");
    let mut reason = None;
    while let Some(e) = s.blocking_next() {
        if let EngineEvent::Finished { reason: r, .. } = e {
            reason = Some(r);
        }
    }
    assert_eq!(reason, Some(FinishReason::Timeout));
    // It ended before any step ran it: nothing of it stays in the runner.
    assert_eq!(
        wait_idle(&engine).executor_requests,
        0,
        "runner state leaked"
    );

    let mut s = engine
        .submit(GenerationRequest {
            prompt_ids: long,
            params,
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .expect("submit");
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(EngineEvent::Token { .. })));
    }
    assert!(engine.stats().kv_blocks_used > 0);
    drop(s);
    let idle = wait_idle(&engine);
    assert_eq!((idle.kv_blocks_used, idle.executor_requests), (0, 0));
}

/// Top-1/top-2 margin (in reference logits) below which bf16 rounding may
/// change the greedy choice: the reference measured that its own bf16
/// compute (which rounds far more than K and V) never changed a top-1 choice
/// whose float32 margin was over 0.25 (`measured` in golden.json).
const NEAR_TIE: f32 = 0.25;

/// Greedy runs of every golden prompt with KV pools of `dtype`: each
/// continuation must follow the reference's until a step where the
/// reference itself nearly ties between its choice and ours. Returns the
/// reference tokens kept and the total.
fn departures_only_at_near_ties(dtype: gemma4_model::paged::KvDtype) -> (usize, usize) {
    let mut shown = Vec::new();
    let (mut kept, mut total) = (0, 0);
    for v in VARIANTS {
        let engine = start(
            oracle_model(v),
            oracle_tokenizer(v),
            EngineConfig {
                max_model_len: 256,
                kv_dtype: dtype,
                ..Default::default()
            },
        )
        .expect("engine");
        let golden = Golden::read(&oracle_fixture(v).join("golden.json")).expect("golden");
        let tensors =
            SafetensorsStore::open_files(&[oracle_fixture(v).join("golden_tensors.safetensors")])
                .expect("golden tensors");
        let vocab = oracle_model(v).config().vocab_size;
        for (i, p) in golden.prompts.iter().enumerate() {
            let (out, _) = collect(&engine, &p.input_ids);
            let want = &p.greedy.generated_ids;
            let leading = out.iter().zip(want).take_while(|(a, b)| a == b).count();
            kept += leading;
            total += want.len();
            shown.push(format!("{v}/{}: {leading}", p.name));
            if leading == want.len() {
                continue;
            }
            // Where it leaves the reference, the reference must rate our
            // token within a near-tie of its own.
            let step: Vec<f32> = tensors
                .get(
                    &format!("prompt{i}.generate_step_logits"),
                    &[want.len(), vocab],
                )
                .and_then(|t| {
                    t.get(leading)
                        .and_then(|row| row.to_vec1::<f32>())
                        .map_err(|e| gemma4_model::WeightError::Missing {
                            name: e.to_string(),
                        })
                })
                .expect("reference step logits");
            let margin = step[want[leading] as usize] - step[out[leading] as usize];
            assert!(
                margin < NEAR_TIE,
                "{} KV, {v}/{}: step {leading} chose {} where the reference chose {} by {margin:.4}",
                dtype.name(),
                p.name,
                out[leading],
                want[leading]
            );
        }
    }
    println!(
        "{} KV, leading reference tokens ({kept} of {total}): {}",
        dtype.name(),
        shown.join(", ")
    );
    (kept, total)
}

/// bf16 pools round K and V once when written (docs/quantization.md gives
/// the counts).
#[test]
fn bf16_kv_cache_leaves_the_reference_only_at_near_ties() {
    let (kept, total) = departures_only_at_near_ties(gemma4_model::paged::KvDtype::Bf16);
    // Most prompts have no near-tie on their path: a cache that rounds
    // wrongly would leave the reference on confident steps and fail above.
    assert!(kept * 10 >= total * 8, "{kept} of {total}");
}

/// int8 pools (a scale per 32 values) are held to the same bound: no
/// departure the reference's own bf16 compute could not make.
#[test]
fn int8_kv_cache_leaves_the_reference_only_at_near_ties() {
    let (kept, total) = departures_only_at_near_ties(gemma4_model::paged::KvDtype::Int8);
    assert!(kept * 10 >= total * 8, "{kept} of {total}");
}

#[test]
fn a_context_longer_than_the_model_positions_is_refused_at_start() {
    let v = VARIANTS[0];
    let m = oracle_model(v);
    let positions = m.config().max_position_embeddings;
    let too_long = EngineConfig {
        max_model_len: positions + 1,
        ..config(64)
    };
    let err = match start(m, oracle_tokenizer(v), too_long) {
        Ok(_) => panic!(
            "an engine started with {} > {positions} positions",
            positions + 1
        ),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&format!("{}", positions + 1))
            && err.contains(&format!("{positions} positions")),
        "{err}"
    );
    // Exactly the model's positions is allowed.
    let exact = EngineConfig {
        max_model_len: positions,
        ..config(64)
    };
    assert!(start(oracle_model(v), oracle_tokenizer(v), exact).is_ok());
}
