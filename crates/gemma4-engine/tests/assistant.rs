//! Speculative decoding with the model's assistant (MTP drafter) against
//! transformers' record of it: each step's drafts are the reference's
//! drafts round for round (its `clean_kv` path: the rows of accepted
//! tokens only, as a cache rolled back after a rejection holds), each
//! verification accepts what the reference's did, and the output is the
//! target's own greedy continuation; whole and chunked prompts, a window
//! far shorter than the longest prompt, through both sides of the seam.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gemma4_engine::executor::{
    DraftOutcome, ExecutorError, ExecutorStats, KvLayout, ModelFacts, StepOutput, StepPlan,
};
use gemma4_engine::{
    start_with, CpuExecutor, EngineConfig, EngineHandle, Executor, SamplingParams,
    SpeculativeConfig,
};
use gemma4_model::{load_hf_dir, Assistant, Gemma4, LoadPolicy};
use gemma4_text::Tokenizer;
use serde_json::Value;

mod support;
use support::{run_request, start_executor_on, Seam, SEAMS};

const FIXTURES: &[&str] = &["e-style-centroid", "dense-k-eq-v-tied"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/assistant")
        .join(name)
}

fn golden(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).expect("golden.json");
    serde_json::from_str(&text).expect("golden json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn count(v: &Value) -> usize {
    v.as_u64().expect("count") as usize
}

/// The CPU executor with its assistant.
fn executor(name: &str) -> CpuExecutor {
    let dir = fixture(name);
    let assistant =
        Assistant::load(&dir.join("assistant"), LoadPolicy::default()).expect("assistant");
    CpuExecutor::new(load_hf_dir(&dir.join("target")).expect("target"))
        .with_assistant(assistant)
        .expect("the assistant fits")
}

fn tokenizer(name: &str) -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_dir(&fixture(name).join("target")).expect("tokenizer"))
}

/// The reference's schedule: 4 drafts every round.
fn config(chunk: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 4,
        max_queue: 8,
        max_model_len: 256,
        block_size: 4,
        max_batch_tokens: chunk,
        speculative: Some(SpeculativeConfig::assistant(4).expect("settings").unpaced()),
        ..Default::default()
    }
}

/// An executor that keeps each sampled chunk's drafting outcome.
struct Recording {
    inner: Box<dyn Executor>,
    log: Arc<Mutex<Vec<DraftOutcome>>>,
}

impl Executor for Recording {
    fn model_facts(&self) -> &ModelFacts {
        self.inner.model_facts()
    }
    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<usize, ExecutorError> {
        self.inner.allocate_kv(layout)
    }
    fn execute(&mut self, plan: StepPlan) -> StepOutput {
        let out = self.inner.execute(plan);
        let mut log = self.log.lock().expect("log");
        for s in &out.seqs {
            if s.result.as_ref().is_ok_and(|sampled| !sampled.is_empty()) {
                log.push(s.drafting.clone());
            }
        }
        out
    }
    fn stats(&self) -> ExecutorStats {
        self.inner.stats()
    }
}

fn recording_engine(
    name: &str,
    seam: Seam,
    chunk: usize,
) -> (EngineHandle, Arc<Mutex<Vec<DraftOutcome>>>) {
    let inner: Box<dyn Executor> = match seam {
        Seam::Direct => Box::new(executor(name)),
        Seam::Threaded => Box::new(
            gemma4_engine::ThreadedExecutor::spawn(executor(name)).expect("executor thread"),
        ),
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let recording = Recording {
        inner,
        log: log.clone(),
    };
    let engine = start_with(Box::new(recording), tokenizer(name), config(chunk)).expect("engine");
    (engine, log)
}

fn generate(engine: &EngineHandle, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let params = SamplingParams {
        max_tokens,
        ..Default::default()
    };
    run_request(engine, prompt, params).0
}

/// Round `r` of the reference is proposed by the sampled chunk before it
/// and verified by the next: the same drafts, the same count verified and
/// accepted; the output is the target's own greedy run.
#[test]
fn the_assistant_drafts_and_verifies_the_reference_rounds() {
    for name in FIXTURES {
        let g = golden(name);
        for (seam, chunk) in [(Seam::Direct, 4096), (Seam::Threaded, 5)] {
            let (engine, log) = recording_engine(name, seam, chunk);
            for p in g["prompts"].as_array().expect("prompts") {
                let label = format!("{name} {} {seam:?} chunk {chunk}", p["name"]);
                log.lock().expect("log").clear();
                let out = generate(&engine, &ids(&p["input_ids"]), 16);
                assert_eq!(out, ids(&p["target_greedy"]["generated_ids"]), "{label}");
                let clean = &p["clean_kv"];
                assert_eq!(out, ids(&clean["generated_ids"]), "{label}");
                let steps = log.lock().expect("log").clone();
                let rounds = clean["rounds"].as_array().expect("rounds");
                assert_eq!(steps.len(), rounds.len() + 1, "{label}: sampled chunks");
                for (r, round) in rounds.iter().enumerate() {
                    let k = count(&round["num_draft"]);
                    let drafts = ids(&round["draft_ids"]);
                    let (before, at) = (&steps[r], &steps[r + 1]);
                    assert_eq!(
                        before.proposed[..k.min(before.proposed.len())],
                        drafts,
                        "{label} round {}: drafts",
                        r + 1
                    );
                    assert_eq!(
                        (at.verified, at.accepted),
                        (k, count(&round["n_accepted"])),
                        "{label} round {}: verified and accepted",
                        r + 1
                    );
                }
            }
        }
    }
}

/// All prompts at once, prompts chunked beside other sequences' drafts:
/// every output is still the target's greedy run, and drafts are accepted.
#[test]
fn batched_requests_draft_with_the_assistant() {
    for name in FIXTURES {
        let g = golden(name);
        let prompts = g["prompts"].as_array().expect("prompts");
        let engine = start_executor_on(SEAMS[0], executor(name), tokenizer(name), config(16));
        let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let engine = engine.clone();
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_millis(2 * i as u64));
                        generate(&engine, &ids(&p["input_ids"]), 16)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        for (o, p) in outs.iter().zip(prompts) {
            assert_eq!(
                o,
                &ids(&p["target_greedy"]["generated_ids"]),
                "{name} {}",
                p["name"]
            );
        }
        let spec = engine.stats().speculation;
        assert!(
            spec.accepted_tokens > 0 && spec.draft_tokens > spec.accepted_tokens,
            "{name}: {spec:?}"
        );
    }
}

/// Asking for assistant drafting from an executor without an assistant is
/// refused when the engine starts, with what is missing named.
#[test]
fn assistant_drafting_needs_an_assistant() {
    let target = load_hf_dir(&fixture(FIXTURES[0]).join("target")).expect("target");
    let err = start_with(
        Box::new(CpuExecutor::new(target)),
        tokenizer(FIXTURES[0]),
        config(64),
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("assistant"), "{err}");
}

/// The model's sampling distribution at the end of `ids`: the `top_k` best
/// tokens with softmax(logits / temperature) over them, as the sampler
/// keeps them.
fn next_token_probabilities(model: &Gemma4, ids: &[u32], temperature: f32) -> Vec<(u32, f64)> {
    let mut cache = model.new_cache();
    let logits = model
        .forward(ids, &mut cache, gemma4_model::LogitsFor::Last, None)
        .expect("forward")
        .flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("f32");
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(CHI_TOP_K);
    let scaled: Vec<f64> = order
        .iter()
        .map(|&i| f64::from(logits[i] / temperature))
        .collect();
    let total: f64 = scaled.iter().map(|x| (x - scaled[0]).exp()).sum();
    order
        .iter()
        .zip(&scaled)
        .map(|(&i, x)| (i as u32, (x - scaled[0]).exp() / total))
        .collect()
}

const CHI_TOP_K: usize = 4;

/// Pearson's statistic of `counts` against `expected` probabilities over
/// the same cells (cells expecting fewer than 5 draws pooled), with its
/// degrees of freedom.
fn chi_square(
    counts: &std::collections::HashMap<(u32, u32), u64>,
    expected: &[((u32, u32), f64)],
    n: u64,
) -> (f64, usize) {
    let (mut stat, mut cells) = (0.0, 0);
    let (mut pooled_seen, mut pooled_expected) = (0.0, 0.0);
    for (cell, p) in expected {
        let seen = counts.get(cell).copied().unwrap_or(0) as f64;
        let e = p * n as f64;
        if e < 5.0 {
            pooled_seen += seen;
            pooled_expected += e;
        } else {
            stat += (seen - e).powi(2) / e;
            cells += 1;
        }
    }
    if pooled_expected > 0.0 {
        stat += (pooled_seen - pooled_expected).powi(2) / pooled_expected;
        cells += 1;
    }
    (stat, cells - 1)
}

/// The chi-square value a statistic with `df` degrees of freedom exceeds
/// with probability 0.001 (Wilson and Hilferty's approximation).
fn chi_square_critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.09;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Sampling with drafts draws from the model's own distribution: the first
/// two tokens of many seeded requests (the second drawn at the position
/// of the assistant's verified draft) counted against the
/// probabilities the model gives directly pass a chi-square test at
/// p = 0.001; against a neighbouring distribution (a hotter temperature)
/// the same counts fail it, so the test can tell.
#[test]
fn sampling_with_drafts_draws_from_the_model_distribution() {
    const REQUESTS: u64 = 2000;
    const THREADS: u64 = 8;
    const TEMPERATURE: f32 = 0.8;
    // The pair whose assistant's greedy drafts were accepted most often.
    let name = "dense-k-eq-v-tied";
    let model = load_hf_dir(&fixture(name).join("target")).expect("target");
    let g = golden(name);
    let prompt = ids(&g["prompts"][3]["input_ids"]);
    let config = EngineConfig {
        max_num_seqs: THREADS as usize,
        max_queue: 2 * THREADS as usize,
        ..config(64)
    };
    let engine = start_with(Box::new(executor(name)), tokenizer(name), config).expect("engine");
    let pairs: Vec<(u32, u32)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (engine, prompt) = (engine.clone(), &prompt);
                s.spawn(move || {
                    (t..REQUESTS)
                        .step_by(THREADS as usize)
                        .map(|seed| {
                            let params = SamplingParams {
                                temperature: TEMPERATURE,
                                top_k: CHI_TOP_K,
                                seed: Some(seed),
                                max_tokens: 3,
                                ..Default::default()
                            };
                            let (out, _) = run_request(&engine, prompt, params);
                            (out[0], out[1])
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("thread"))
            .collect()
    });
    let drafts = engine.stats().speculation;
    assert!(
        drafts.accepted_tokens >= REQUESTS / 20,
        "{drafts:?}: too few drafts accepted to exercise verification"
    );
    let mut counts = std::collections::HashMap::new();
    for p in &pairs {
        *counts.entry(*p).or_insert(0u64) += 1;
    }
    let expected = |temperature: f32| -> Vec<((u32, u32), f64)> {
        let mut cells = Vec::new();
        for (a, pa) in next_token_probabilities(&model, &prompt, temperature) {
            let after = [&prompt[..], &[a]].concat();
            for (b, pb) in next_token_probabilities(&model, &after, temperature) {
                cells.push(((a, b), pa * pb));
            }
        }
        cells
    };
    let model_cells = expected(TEMPERATURE);
    for cell in counts.keys() {
        assert!(
            model_cells.iter().any(|(c, _)| c == cell),
            "{cell:?} was sampled but is outside the model's top {CHI_TOP_K} tokens"
        );
    }
    let (stat, df) = chi_square(&counts, &model_cells, REQUESTS);
    let critical = chi_square_critical(df);
    assert!(
        stat < critical,
        "chi-square {stat:.1} with {df} degrees of freedom exceeds {critical:.1}"
    );
    let (hotter, hot_df) = chi_square(&counts, &expected(2.0 * TEMPERATURE), REQUESTS);
    eprintln!(
        "{drafts:?}; chi-square {stat:.1} ({df} degrees, bound {critical:.1}); against the hotter distribution {hotter:.1} ({hot_df} degrees)"
    );
    let df = hot_df;
    assert!(
        hotter > chi_square_critical(df),
        "the counts fit a hotter distribution too ({hotter:.1}, {df} degrees): the test cannot tell"
    );
}
