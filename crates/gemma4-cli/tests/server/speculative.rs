//! `serve --speculative ngram` and `--speculative assistant`: drafts never
//! change what is served (the oracle's greedy ids, whole and streamed
//! alike), `/metrics` counts them under vLLM's names, and a request on any
//! API can turn them off.

use serde_json::json;

use super::harness::{fixture, golden, openai_error, python_script, EventStream, ServerProc};
use super::{generate_ids, golden_ids, ids};

/// N-gram drafting that finds a match wherever the last token occurred
/// before, so the tiny fixtures draft often.
const NGRAM: [&str; 6] = [
    "--speculative",
    "ngram",
    "--ngram-min",
    "1",
    "--ngram-max",
    "3",
];

#[test]
fn drafting_keeps_the_oracle_output_and_counts_drafts() {
    for variant in ["e-style", "moe"] {
        let server = ServerProc::start(&fixture(variant), &NGRAM, &[]);
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

/// Anthropic's and Ollama's routes turn drafting off per request as the
/// OpenAI routes do, through their official clients (`extra_body` in the
/// anthropic SDK, `options` in Ollama's): the same greedy reply with
/// nothing drafted, where the same turn with drafting on drafts; a value
/// that is not a boolean is a 400 in the API's shape naming the field.
#[test]
fn anthropic_and_ollama_requests_turn_drafting_off() {
    let server = ServerProc::start(&fixture("e-style"), &NGRAM, &[]);
    let drafted = || server.metric("vllm:spec_decode_num_draft_tokens_total");
    let url = server.url();
    // One greedy turn through a client script, its own arguments first.
    let turn = |script: &str, module: &str, own: &[&str], setting: &str| {
        let mut args = own.to_vec();
        args.extend(["--model", "e-style", "--prompt", "Tell me about the sea."]);
        args.extend(["--max-tokens", "24", "--speculative-decoding", setting]);
        python_script(script, &[module], &args)
    };
    let anthropic = |setting: &str| {
        let own = ["--base-url", &url, "--scenario", "one_turn"];
        turn("anthropic_client.py", "anthropic", &own, setting)
    };
    let ollama = |setting: &str| turn("ollama_client.py", "ollama", &["--host", &url], setting);
    type Client<'a> = &'a dyn Fn(&str) -> Option<serde_json::Value>;
    for (api, run) in [("anthropic", &anthropic as Client), ("ollama", &ollama)] {
        let before = drafted();
        let Some(off) = run("off") else {
            return;
        };
        assert!(off.get("error").is_none(), "{api}: {off}");
        assert_eq!(
            drafted(),
            before,
            "{api}: a request with drafting off drafted"
        );
        let on = run("on").expect("the client ran once");
        assert!(
            drafted() > before,
            "{api}: the same turn with drafting on drafted nothing"
        );
        assert_eq!(on["text"], off["text"], "{api}");
        let bad = run("bad").expect("the client ran once");
        assert_eq!(bad["error"]["status"], 400, "{api}: {bad}");
        let message = match api {
            "anthropic" => &bad["error"]["body"]["error"]["message"],
            _ => &bad["error"]["error"],
        };
        let field = match api {
            "anthropic" => "`speculative_decoding`",
            _ => "`options.speculative_decoding`",
        };
        assert!(
            message.as_str().is_some_and(|m| m.contains(field)),
            "{api}: {bad}"
        );
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
