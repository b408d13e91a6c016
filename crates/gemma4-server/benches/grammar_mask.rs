//! What enforced structured output costs: decode throughput of 4 concurrent
//! streams with and without a grammar mask, on a randomly initialised model
//! with the e-style layout scaled up and Gemma 4's real 262,144-entry
//! vocabulary (the mask covers all of it every step). Prints both rates and
//! their ratio, measured in the same run, in alternating rounds; and the
//! cost of the number limit on top of the mask: the same JSON grammar as a
//! Lark `%json` rule, which llguidance masks alone, against the schema,
//! whose numbers the server also keeps to a double's digits.

use std::sync::Arc;
use std::time::Instant;

use gemma4_engine::{start, EngineConfig, EngineEvent, GenerationRequest, SamplingParams};
use gemma4_model::config::TextConfig;
use gemma4_model::{Gemma4, LoadPolicy, RandomWeights, Weights};
use gemma4_server::grammar::{GrammarSpec, Grammars};
use gemma4_text::Tokenizer;

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model(vocab: usize) -> Gemma4 {
    let dir = root().join("tests/fixtures/oracle/e-style");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
            .expect("json");
    let t = &mut json["text_config"];
    t["hidden_size"] = 256.into();
    t["intermediate_size"] = 1024.into();
    t["num_attention_heads"] = 4.into();
    t["head_dim"] = 64.into();
    t["global_head_dim"] = 128.into();
    t["sliding_window"] = 128.into();
    t["vocab_size"] = vocab.into();
    t["vocab_size_per_layer_input"] = vocab.into();
    let cfg = TextConfig::from_hf_json(&json).expect("config");
    Gemma4::load(cfg, &Weights::new(&RandomWeights, LoadPolicy::default())).expect("model")
}

fn main() {
    const STREAMS: usize = 4;
    const NEW_TOKENS: usize = 48;
    let tok = Arc::new(
        Tokenizer::from_gguf(&root().join("tests/fixtures/text/ggml-vocab-gemma-4.gguf"))
            .expect("real Gemma 4 vocabulary"),
    );
    let vocab = tok.vocab_size();
    let grammars = Grammars::new(tok.clone()).expect("token trie");
    // An array of integers never completes, so every step is masked.
    // The integers' bounds and the layout are what the server adds to a
    // schema, written out so that the Lark form is the same grammar.
    let schema = serde_json::json!({"type": "array",
        "items": {"type": "integer", "minimum": -9_007_199_254_740_991_i64, "maximum": 9_007_199_254_740_991_i64},
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
    let spec = GrammarSpec::JsonSchema(schema.clone());
    let unlimited = GrammarSpec::Lark(format!("start: %json {schema}"));
    println!(
        "decode with a grammar mask: {STREAMS} streams x {NEW_TOKENS} tokens, vocabulary {vocab}, e-style layout (hidden 256)"
    );
    let engine = start(
        model(vocab),
        tok.clone(),
        EngineConfig {
            max_num_seqs: STREAMS,
            max_model_len: 256,
            ..Default::default()
        },
    )
    .expect("engine");
    let run = |grammar: Option<&GrammarSpec>, temperature: f32| -> f64 {
        let began = Instant::now();
        let tokens: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..STREAMS)
                .map(|i| {
                    let engine = engine.clone();
                    let constraint = grammar.map(|spec| {
                        let compiled = grammars.compile(spec, "response_format").expect("compiles");
                        grammars.constraint(compiled, None)
                    });
                    s.spawn(move || {
                        let prompt: Vec<u32> = std::iter::once(2)
                            .chain((0..16).map(|j| 1000 + ((i * 31 + j * 7) % 5000) as u32))
                            .collect();
                        let params = SamplingParams {
                            max_tokens: NEW_TOKENS,
                            temperature,
                            seed: Some(i as u64),
                            constraint,
                            ..Default::default()
                        };
                        let mut stream = engine
                            .submit(GenerationRequest {
                                prompt_ids: prompt,
                                params,
                                deadline: None,
                                soft_prompt: None,
                                reading: Default::default(),
                                adapter: None,
                            })
                            .expect("submit");
                        let mut n = 0;
                        while let Some(e) = stream.blocking_next() {
                            match e {
                                EngineEvent::PromptLogprobs(_) => {}
                                EngineEvent::Token { .. } => n += 1,
                                EngineEvent::Finished { .. } => break,
                            }
                        }
                        n
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        tokens as f64 / began.elapsed().as_secs_f64()
    };
    run(None, 0.0); // warm-up
                    // Greedy isolates the mask's cost; sampled runs also gain from the mask,
                    // which leaves fewer candidates to sort. Rounds alternate the runs, and
                    // the median ratio is reported.
    const ROUNDS: usize = 5;
    let median = |mut ratios: Vec<f64>| {
        ratios.sort_by(f64::total_cmp);
        (ratios[ROUNDS / 2], ratios[0], ratios[ROUNDS - 1])
    };
    let limited: Vec<f64> = (0..ROUNDS)
        .map(|_| run(Some(&spec), 0.0) / run(Some(&unlimited), 0.0))
        .collect();
    let (mid, low, high) = median(limited);
    println!(
        "  number limit: greedy, the schema against the same grammar without it: {mid:.3}x (median of {ROUNDS}, range {low:.3}-{high:.3})"
    );
    for (mode, temperature) in [("greedy", 0.0), ("sampled", 1.0)] {
        let mut rounds: Vec<(f64, f64)> = (0..ROUNDS)
            .map(|_| (run(None, temperature), run(Some(&spec), temperature)))
            .collect();
        rounds.sort_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)));
        let (free, masked) = rounds[ROUNDS / 2];
        let low = rounds[0].1 / rounds[0].0;
        let high = rounds[ROUNDS - 1].1 / rounds[ROUNDS - 1].0;
        println!(
            "  {mode:>7}: unconstrained {free:>7.1} tokens/s, grammar mask {masked:>7.1} tokens/s (median of {ROUNDS}: {:.3}x, range {low:.3}-{high:.3})",
            masked / free
        );
    }
}
