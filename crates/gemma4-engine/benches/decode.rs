//! Aggregate decode throughput at 1, 4 and 16 concurrent sequences on a
//! randomly initialised model with the e-style (E2B-like) layout, scaled
//! up so the matrix work is not negligible. Prints tokens/s and the gain
//! over one sequence, measured in the same run; then the same through the
//! threaded executor (the plans sent over a channel to another thread),
//! as a ratio to the direct call, each pair run back to back.

use std::sync::Arc;
use std::time::Instant;

use gemma4_engine::{
    start_with, CpuExecutor, EngineConfig, EngineHandle, Executor, GenerationRequest,
    SamplingParams, ThreadedExecutor,
};
use gemma4_model::config::TextConfig;
use gemma4_model::{Gemma4, LoadPolicy, RandomWeights, Weights};
use gemma4_text::Tokenizer;

fn model() -> (Gemma4, Arc<Tokenizer>) {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/e-style");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
            .expect("json");
    let t = &mut json["text_config"];
    t["hidden_size"] = 512.into();
    t["intermediate_size"] = 2048.into();
    t["num_attention_heads"] = 8.into();
    t["head_dim"] = 64.into();
    t["global_head_dim"] = 128.into();
    t["sliding_window"] = 128.into();
    let cfg = TextConfig::from_hf_json(&json).expect("config");
    let model =
        Gemma4::load(cfg, &Weights::new(&RandomWeights, LoadPolicy::default())).expect("model");
    (
        model,
        Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer")),
    )
}

fn main() {
    const NEW_TOKENS: usize = 32;
    let mut baseline = None;
    println!("decode throughput, e-style layout (hidden 512, 8 layers), {NEW_TOKENS} new tokens per sequence");
    println!("  (direct: the engine calls the CPU executor; threaded: through ThreadedExecutor)");
    for concurrency in [1usize, 4, 16] {
        let mut rates = [0.0; 2];
        for (r, threaded) in rates.iter_mut().zip([false, true]) {
            *r = throughput(engine(threaded), concurrency, NEW_TOKENS);
        }
        let [direct, threaded] = rates;
        let base = *baseline.get_or_insert(direct);
        println!(
            "  {concurrency:>2} sequences: {direct:>9.1} tokens/s  ({:.2}x one sequence); threaded {threaded:>9.1} tokens/s ({:.3}x direct)",
            direct / base,
            threaded / direct
        );
    }
}

fn engine(threaded: bool) -> EngineHandle {
    let (model, tok) = model();
    let cpu = CpuExecutor::new(model);
    let executor: Box<dyn Executor> = if threaded {
        Box::new(ThreadedExecutor::spawn(cpu).expect("executor thread"))
    } else {
        Box::new(cpu)
    };
    let config = EngineConfig {
        max_num_seqs: 16,
        max_model_len: 256,
        ..Default::default()
    };
    start_with(executor, tok, config).expect("engine")
}

/// Tokens per second of `concurrency` greedy requests of `new_tokens` each.
fn throughput(engine: EngineHandle, concurrency: usize, new_tokens: usize) -> f64 {
    let began = Instant::now();
    let tokens: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..concurrency)
            .map(|i| {
                let engine = engine.clone();
                s.spawn(move || {
                    let prompt: Vec<u32> = std::iter::once(2)
                        .chain((0..16).map(|j| 120 + ((i * 31 + j * 7) % 380) as u32))
                        .collect();
                    let params = SamplingParams {
                        max_tokens: new_tokens,
                        ..Default::default()
                    };
                    engine
                        .submit(GenerationRequest::new(prompt, params))
                        .expect("submit")
                        .blocking_finish()
                        .map_or(0, |(ids, _)| ids.len())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).sum()
    });
    tokens as f64 / began.elapsed().as_secs_f64()
}
