//! `serve --speculative ngram` and `--speculative assistant`: drafts never
//! change what is served (the oracle's greedy ids, whole and streamed
//! alike), and `/metrics` counts them under vLLM's names.

use serde_json::json;

use super::harness::{fixture, golden, openai_error, EventStream, ServerProc};
use super::{generate_ids, golden_ids, ids};

#[test]
fn drafting_keeps_the_oracle_output_and_counts_drafts() {
    let drafting = [
        "--speculative",
        "ngram",
        "--ngram-min",
        "1",
        "--ngram-max",
        "3",
    ];
    for variant in ["e-style", "moe"] {
        let server = ServerProc::start(&fixture(variant), &drafting, &[]);
        let g = golden(variant);
        for p in g["prompts"].as_array().expect("prompts") {
            let expected = golden_ids(p);
            let out = generate_ids(&server, &p["input_ids"], expected.len());
            assert_eq!(ids(&out["token_ids"]), expected, "{variant}/{}", p["name"]);
            // Streamed, several tokens may come from one step: the text is the same.
            let body = json!({
                "prompt": p["input_ids"], "max_tokens": expected.len(), "temperature": 0,
                "ignore_eos": true, "stream": true
            });
            let mut stream = EventStream::open(server.port, "/v1/completions", &body);
            let streamed: String = stream
                .rest()
                .iter()
                .filter(|d| d.as_str() != "[DONE]")
                .map(|d| {
                    let v: serde_json::Value = serde_json::from_str(d).expect("chunk");
                    v["choices"][0]["text"].as_str().unwrap_or("").to_string()
                })
                .collect();
            assert_eq!(streamed, out["response"].as_str().expect("response"));
        }
        let drafted = "vllm:spec_decode_num_draft_tokens_total";
        let accepted = "vllm:spec_decode_num_accepted_tokens_total";
        let steps = "vllm:spec_decode_num_drafts_total";
        let (d, a, s) = (
            server.metric(drafted),
            server.metric(accepted),
            server.metric(steps),
        );
        assert!(a > 0.0 && d > a && s > 0.0 && d >= s, "{d} {a} {s}");
        // A request may decode one token a step: the same ids, no drafts.
        let p = &g["prompts"][0];
        let expected = golden_ids(p);
        let body = json!({
            "prompt": p["input_ids"], "max_tokens": expected.len(), "temperature": 0,
            "ignore_eos": true, "speculative_decoding": false
        });
        let r = server.post("/generate", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(ids(&r.json()["token_ids"]), expected);
        assert_eq!(server.metric(drafted), d, "a plain request drafted");
        let bad = json!({"prompt": "Hello", "max_tokens": 2, "speculative_decoding": "no"});
        let r = server.post("/v1/completions", &bad);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(openai_error(&r)["param"], "speculative_decoding");
    }
}

/// The model's assistant drafts for every request; what is served is the
/// target's own greedy run, and the drafts are counted.
#[test]
fn an_assistant_drafts_for_the_server() {
    for name in ["e-style-centroid", "dense-k-eq-v-tied"] {
        let dir = fixture("assistant").join(name);
        let assistant = dir.join("assistant");
        let drafting = [
            "--speculative",
            "assistant",
            "--draft-model",
            assistant.to_str().expect("path"),
        ];
        let server = ServerProc::start(&dir.join("target"), &drafting, &[]);
        let g = golden(&format!("assistant/{name}"));
        for p in g["prompts"].as_array().expect("prompts") {
            let expected = ids(&p["target_greedy"]["generated_ids"]);
            let out = generate_ids(&server, &p["input_ids"], expected.len());
            assert_eq!(ids(&out["token_ids"]), expected, "{name}/{}", p["name"]);
        }
        let drafted = server.metric("vllm:spec_decode_num_draft_tokens_total");
        assert!(drafted > 0.0, "{name}: {drafted} drafted");
    }
}

/// Settings out of range stop the server before it loads, naming the flag.
#[test]
fn speculative_settings_out_of_range_are_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gemma4"))
        .args(["serve", "--model"])
        .arg(fixture("e-style"))
        .args(["--speculative", "ngram", "--num-speculative-tokens", "40"])
        .output()
        .expect("run gemma4");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--num-speculative-tokens") && err.contains("from 1 to 7"),
        "{err}"
    );
}
