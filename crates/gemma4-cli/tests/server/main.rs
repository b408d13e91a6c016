//! `gemma4 serve` over real loopback HTTP: the tiny oracle checkpoints
//! (tests/fixtures/oracle) answer in milliseconds, so every test starts its
//! own server process. Outputs are compared with references: the oracle's
//! greedy token ids, and each prompt's solo run. The `openai` Python client
//! checks run `tests/python/openai_client.py`.

mod anthropic;
mod conformance;
mod harness;
mod images;
mod lora;
mod mcp;
mod ollama;
mod protocol;
mod real_vocab;
mod render;
mod routing;
mod schemas;
mod scoring;
mod skill;
mod speculative;
mod webui;

use std::time::{Duration, Instant};

use harness::{
    armed_openai_client, fixture, golden, openai_client, openai_error, python_script, request,
    EventStream, ServerProc,
};
use serde_json::{json, Value};

const VARIANTS: [&str; 4] = ["e-style", "dense-k-eq-v", "moe", "unified"];

/// The oracle's greedy continuation ids of a golden prompt.
fn golden_ids(prompt: &Value) -> Vec<u64> {
    prompt["greedy"]["generated_ids"]
        .as_array()
        .expect("generated_ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

/// `/generate` on token ids, greedy, ignoring EOS as the oracle does.
fn generate_ids(server: &ServerProc, prompt_ids: &Value, max_tokens: usize) -> Value {
    let r = server.post(
        "/generate",
        &json!({"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn prompt_named<'a>(g: &'a Value, name: &str) -> &'a Value {
    g["prompts"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no prompt {name}"))
}

#[test]
fn greedy_output_matches_the_oracle_on_every_variant() {
    for variant in VARIANTS {
        let server = ServerProc::start(&fixture(variant), &[], &[]);
        let g = golden(variant);
        for p in g["prompts"].as_array().expect("prompts") {
            let expected = golden_ids(p);
            let out = generate_ids(&server, &p["input_ids"], expected.len());
            assert_eq!(
                ids(&out["token_ids"]),
                expected,
                "{variant}/{}: greedy ids differ from the oracle",
                p["name"]
            );
            assert_eq!(out["finish_reason"], "length");
            assert_eq!(out["usage"]["completion_tokens"], expected.len());
        }
        // The chat route renders the checkpoint's template to the oracle's ids (one BOS)
        // and continues exactly as the same ids do through /generate.
        let chat = prompt_named(&g, "chat");
        let reference = generate_ids(&server, &chat["input_ids"], 24);
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": chat["messages"], "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(r.status, 200, "{variant}: {}", r.body);
        let body = r.json();
        assert_eq!(
            body["usage"]["prompt_tokens"], chat["n_tokens"],
            "{variant}: chat prompt tokens"
        );
        assert_eq!(
            body["choices"][0]["message"]["content"], reference["response"],
            "{variant}: chat text"
        );
    }
}

#[test]
fn openai_client_chat_and_completions_streaming_and_not() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let chat = prompt_named(&g, "chat");
    let question = chat["messages"][0]["content"]
        .as_str()
        .expect("chat message");
    let chat_ref = generate_ids(&server, &chat["input_ids"], 24);
    let short = prompt_named(&g, "short");
    let completion_ref = generate_ids(&server, &short["input_ids"], 24);
    assert_eq!(ids(&completion_ref["token_ids"]), golden_ids(short));

    let Some(chat_out) = openai_client(
        &server.url(),
        &[
            "--scenario",
            "basic",
            "--prompt",
            question,
            "--max-tokens",
            "24",
        ],
    ) else {
        return;
    };
    assert_eq!(chat_out["models"], json!(["e-style"]));
    let c = &chat_out["chat"];
    assert_eq!(
        c["text"], chat_ref["response"],
        "chat text vs the same ids through /generate"
    );
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["object"], "chat.completion");
    assert!(c["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(
        c["usage"],
        json!({"prompt_tokens": 38, "completion_tokens": 24, "total_tokens": 62,
               "completion_tokens_details": {"reasoning_tokens": 0}})
    );
    let n2 = &chat_out["chat_n2"];
    assert_eq!(n2["indexes"], json!([0, 1]));
    assert_eq!(
        n2["texts"],
        json!([chat_ref["response"], chat_ref["response"]]),
        "greedy choices are identical"
    );
    assert_eq!(n2["usage"]["completion_tokens"], 48);
    let s = &chat_out["chat_stream"];
    assert_eq!(
        s["text"], c["text"],
        "streamed chat equals the non-streamed one"
    );
    assert_eq!(s["role"], "assistant");
    assert_eq!(s["finish_reason"], "length");
    assert_eq!(s["usage"], c["usage"]);

    let Some(out) = openai_client(
        &server.url(),
        &[
            "--scenario",
            "basic",
            "--prompt",
            "Hello world",
            "--max-tokens",
            "24",
        ],
    ) else {
        return;
    };
    let c = &out["completion"];
    assert_eq!(
        c["text"], completion_ref["response"],
        "completion text vs the oracle's ids through /generate"
    );
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(
        c["usage"],
        json!({"prompt_tokens": 8, "completion_tokens": 24, "total_tokens": 32})
    );
    let s = &out["completion_stream"];
    assert_eq!(
        s["text"], c["text"],
        "streamed completion equals the non-streamed one"
    );
    assert_eq!(s["usage"], c["usage"]);
    assert_eq!(s["finish_reason"], "length");

    // Metrics saw all of that, and every KV block is free again.
    let metrics = server.get("/metrics");
    assert!(
        metrics
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/plain")),
        "{:?}",
        metrics.headers
    );
    assert!(
        server.metric("gemma4_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"}")
            >= 4.0
    );
    assert!(server.metric("gemma4_generation_tokens_total") >= 24.0 * 8.0);
    assert!(server.metric("gemma4_prompt_tokens_total") > 0.0);
    assert!(server.metric("gemma4_time_to_first_token_seconds_count") >= 8.0);
    assert!(server.metric("gemma4_inter_token_latency_seconds_count") > 0.0);
    assert!(server.metric("gemma4_resident_memory_bytes") > 1e6);
    let settle = Duration::from_secs(2);
    server.wait_metric("gemma4_running_sequences", 0.0, settle);
    server.wait_metric("gemma4_queue_depth", 0.0, settle);
    server.wait_metric("gemma4_kv_blocks_used", 0.0, settle);
    assert!(server.metric("gemma4_kv_blocks_free") > 0.0);
    server.metric("gemma4_prefix_cache_hits_total");
    server.metric("gemma4_preemptions_total");
}

#[test]
fn sixteen_concurrent_streams_equal_their_solo_runs() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let mut prompts: Vec<String> = ["short", "long"]
        .iter()
        .map(|n| {
            prompt_named(&g, n)["text"]
                .as_str()
                .expect("text")
                .to_string()
        })
        .collect();
    prompts.extend(
        [
            "The river",
            "naive cafe",
            "Paris is",
            "one two three",
            "model tokens",
            "Hello Hello Hello",
        ]
        .map(String::from),
    );
    let mut args = vec!["--scenario", "concurrent", "--max-tokens", "24"];
    for p in &prompts {
        args.extend(["--prompt", p.as_str()]);
    }
    let Some(out) = openai_client(&server.url(), &args) else {
        return;
    };
    let solo = out["solo"].as_array().expect("solo");
    let concurrent = out["concurrent"].as_array().expect("concurrent");
    assert_eq!(concurrent.len(), 16);
    for (s, c) in solo.iter().zip(concurrent) {
        assert_eq!((&s["kind"], &s["prompt"]), (&c["kind"], &c["prompt"]));
        assert!(
            s["text"].as_str().is_some_and(|t| !t.is_empty()),
            "empty output for {s}"
        );
        assert_eq!(
            c["text"], s["text"],
            "{} {:?}: concurrent stream differs from its solo run",
            c["kind"], c["prompt"]
        );
        assert_eq!(c["finish_reason"], "length");
    }
    // The solo completions of the oracle's prompts are the oracle's greedy continuations.
    for name in ["short", "long"] {
        let p = prompt_named(&g, name);
        let reference = generate_ids(&server, &p["input_ids"], 24);
        assert_eq!(ids(&reference["token_ids"]), golden_ids(p));
        let s = solo
            .iter()
            .find(|s| s["kind"] == "completion" && s["prompt"] == p["text"])
            .expect("solo run");
        assert_eq!(s["text"], reference["response"], "{name}");
    }
    server.wait_metric("gemma4_kv_blocks_used", 0.0, Duration::from_secs(2));
}

#[test]
fn full_queue_answers_429_with_retry_after() {
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--max-num-seqs", "1", "--max-queue", "1"],
        &[],
    );
    // The client is started and ready before the server is filled, so its
    // burst lands while the two long requests (about two seconds each on a
    // fast machine) still hold the one running slot and the one queue place.
    let Some(client) = armed_openai_client(
        &server.url(),
        &[
            "--scenario",
            "queue",
            "--count",
            "6",
            "--max-tokens",
            "300",
            "--prompt",
            "Hello world",
        ],
    ) else {
        return;
    };
    let long = json!({"prompt": "Hello world", "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut running = EventStream::open(server.port, "/v1/completions", &long);
    assert!(running.next_data().is_some());
    server.wait_metric("gemma4_running_sequences", 1.0, Duration::from_secs(5));
    let queued = EventStream::open(server.port, "/v1/completions", &long);
    server.wait_metric("gemma4_queue_depth", 1.0, Duration::from_secs(5));
    let out = client.go();
    assert_eq!(
        server.metric("gemma4_queue_depth"),
        1.0,
        "the long request left the queue before the burst was answered"
    );
    let outcomes = out["outcomes"].as_array().expect("outcomes");
    let limited: Vec<&Value> = outcomes.iter().filter(|o| o["status"] == 429).collect();
    assert_eq!(limited.len(), 6, "all refused while full: {outcomes:?}");
    drop((running, queued));
    server.wait_metric("gemma4_queue_depth", 0.0, Duration::from_secs(5));
    server.wait_metric("gemma4_running_sequences", 0.0, Duration::from_secs(5));
    for o in limited {
        assert_eq!(o["class"], "RateLimitError");
        assert_eq!(o["retry_after"], "1");
        assert!(
            o["message"]
                .as_str()
                .is_some_and(|m| m.contains("--max-queue")),
            "{o}"
        );
    }
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "the server recovers: {}", r.body);
}

#[test]
fn request_timeout_ends_requests_with_a_clear_error_and_frees_blocks() {
    let server = ServerProc::start(&fixture("e-style"), &["--request-timeout", "0.4"], &[]);
    let long = json!({"prompt": "Hello world", "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut stream = EventStream::open(server.port, "/v1/completions", &long);
    let events = stream.rest();
    let n = events.len();
    assert!(n >= 2, "{events:?}");
    assert_eq!(events[n - 1], "[DONE]");
    let err: Value = serde_json::from_str(&events[n - 2]).expect("error event is JSON");
    assert_eq!(err["error"]["code"], "request_timeout", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--request-timeout")),
        "{err}"
    );

    let mut plain = long.clone();
    plain["stream"] = json!(false);
    let r = server.post("/v1/completions", &plain);
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(openai_error(&r)["code"], "request_timeout");

    if let Some(out) = openai_client(
        &server.url(),
        &["--scenario", "timeout", "--max-tokens", "4000"],
    ) {
        assert_eq!(out["plain"]["status"], 504, "{out}");
        assert!(
            out["stream"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("--request-timeout")),
            "{out}"
        );
    }
    assert!(server.metric("gemma4_requests_finished_total{reason=\"timeout\"}") >= 2.0);
    server.wait_metric("gemma4_running_sequences", 0.0, Duration::from_secs(2));
    server.wait_metric("gemma4_kv_blocks_used", 0.0, Duration::from_secs(2));
}

#[test]
fn client_disconnect_cancels_the_request() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let body = json!({"prompt": "Hello world", "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut stream = EventStream::open(server.port, "/v1/completions", &body);
    assert!(stream.next_data().is_some());
    server.wait_metric("gemma4_running_sequences", 1.0, Duration::from_secs(2));
    drop(stream);
    // The request ends as cancelled, well short of its 4,000 tokens, however
    // fast the machine: one that ran on would end by length, all generated.
    let cancelled = "gemma4_requests_finished_total{reason=\"cancelled\"}";
    let left = Instant::now();
    while server.metric_or_zero(cancelled) != 1.0 {
        assert!(
            left.elapsed() < Duration::from_secs(60),
            "the request was not cancelled after its client left"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let generated = server.metric("gemma4_generation_tokens_total");
    assert!(generated < 4000.0, "{generated} tokens generated");
    server.wait_metric("gemma4_running_sequences", 0.0, Duration::from_secs(5));
    server.wait_metric("gemma4_kv_blocks_used", 0.0, Duration::from_secs(5));
}

#[test]
fn api_key_guards_model_routes_only() {
    let key = "k-3f9a1c";
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--served-model-name", "tiny"],
        &[("GEMMA4_API_KEY", key)],
    );
    let body = json!({"prompt": "Hello", "max_tokens": 2}).to_string();
    let bearer = format!("Bearer {key}");
    for (path, method) in [
        ("/v1/completions", "POST"),
        ("/generate", "POST"),
        ("/v1/models", "GET"),
        ("/v1/chat/completions", "POST"),
    ] {
        let r = request(server.port, method, path, &[], Some(body.as_bytes()));
        assert_eq!(r.status, 401, "{path} without a key: {}", r.body);
        let err = openai_error(&r);
        assert_eq!(err["code"], "invalid_api_key");
        assert!(err["message"]
            .as_str()
            .is_some_and(|m| m.contains("Authorization: Bearer")));
        let wrong = request(
            server.port,
            method,
            path,
            &[("Authorization", "Bearer k-3f9a1d")],
            Some(body.as_bytes()),
        );
        assert_eq!(wrong.status, 401, "{path} with a wrong key");
    }
    let ok = request(
        server.port,
        "POST",
        "/v1/completions",
        &[("Authorization", &bearer)],
        Some(body.as_bytes()),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["model"], "tiny");
    let models = request(
        server.port,
        "GET",
        "/v1/models",
        &[("Authorization", &bearer)],
        None,
    );
    assert_eq!(models.json()["data"][0]["id"], "tiny");
    assert_eq!(server.get("/health").status, 200, "/health stays open");
    assert_eq!(server.get("/ready").status, 200, "/ready stays open");
    assert_eq!(server.get("/metrics").status, 200, "/metrics stays open");

    if let Some(out) = openai_client(
        &server.url(),
        &["--scenario", "auth", "--api-key", key, "--max-tokens", "2"],
    ) {
        assert_eq!(out["wrong_key"]["status"], 401);
        assert_eq!(out["wrong_key"]["class"], "AuthenticationError");
        assert_eq!(out["right_key"]["finish_reason"], "length");
    }
}

#[test]
fn sigterm_drains_a_running_stream_then_exits_0() {
    let mut server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let body = json!({
        "prompt": "Hello world", "max_tokens": 1000, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true}
    });
    let mut stream = EventStream::open(server.port, "/v1/completions", &body);
    let first = stream.next_data().expect("first event");
    server.terminate();
    // Draining once the signal is handled: still alive, no longer ready.
    let signalled = Instant::now();
    let health = loop {
        let health = server.get("/health");
        if health.status != 200 || health.json()["status"] == "draining" {
            break health;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(30),
            "still not draining: {}",
            health.body
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(health.status, 200, "{}", health.body);
    assert_eq!(health.json()["status"], "draining");
    let ready = server.get("/ready");
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(ready.json()["status"], "draining");
    let refused = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(openai_error(&refused)["code"], "server_draining");

    let mut events = vec![first];
    events.extend(stream.rest());
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "the stream completes"
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).expect("usage chunk");
    assert_eq!(
        usage["usage"]["completion_tokens"], 1000,
        "all tokens were generated: {usage}"
    );
    let finish = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| !v["choices"][0]["finish_reason"].is_null());
    assert_eq!(
        finish.expect("finish chunk")["choices"][0]["finish_reason"],
        "length"
    );
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "exit status {status}:\n{}", server.log());
}

#[test]
fn bad_requests_get_openai_errors_that_name_the_problem() {
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--max-model-len", "64", "--max-body", "4096"],
        &[],
    );
    let user = json!([{"role": "user", "content": "hi"}]);
    let long_prompt = "word ".repeat(200);
    let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(5000));
    // (path, body, status, text in the message, param)
    let cases: Vec<(&str, String, u16, &str, Option<&str>)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "not valid JSON", None),
        ("/v1/chat/completions", "[1, 2]".into(), 400, "must be a JSON object", None),
        ("/v1/chat/completions", json!({"messages": user, "temperature": "hot"}).to_string(), 400, "`temperature` must be a number", Some("temperature")),
        ("/v1/chat/completions", json!({"messages": user, "max_tokens": "5"}).to_string(), 400, "`max_tokens` must be an integer", Some("max_tokens")),
        ("/v1/chat/completions", json!({"messages": user, "stream": "yes"}).to_string(), 400, "`stream`", Some("stream")),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400, "`messages` is empty", Some("messages")),
        ("/v1/chat/completions", json!({"model": "e-style"}).to_string(), 400, "`messages` is required", Some("messages")),
        ("/v1/chat/completions", json!({"messages": [{"role": "user"}]}).to_string(), 400, "`messages[0].content`", Some("messages[0].content")),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).to_string(), 400, "no vision tower", Some("messages[0].content[0].image_url.url")),
        ("/v1/chat/completions", json!({"messages": user, "model": "gpt-4"}).to_string(), 404, "`gpt-4` does not exist", Some("model")),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": -1}).to_string(), 400, "at least 0", Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 1000}).to_string(), 400, "max_model_len", Some("max_tokens")),
        ("/v1/completions", json!({"prompt": long_prompt}).to_string(), 400, "--max-model-len", Some("prompt")),
        ("/v1/completions", json!({"prompt": [2, 999999]}).to_string(), 400, "outside the vocabulary", Some("prompt")),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": {"999999": 1}}).to_string(), 400, "`logit_bias`: token id 999999 is outside the vocabulary", Some("logit_bias")),
        ("/v1/chat/completions", json!({"messages": user, "stop_token_ids": [999999]}).to_string(), 400, "`stop_token_ids`: token id 999999", Some("stop_token_ids")),
        ("/v1/completions", json!({"prompt": "hi", "n": 100}).to_string(), 400, "--max-queue", Some("n")),
        ("/v1/completions", json!({"prompt": "hi", "top_p": 1.5}).to_string(), 400, "`top_p`", Some("top_p")),
        ("/v1/completions", json!({"prompt": 5}).to_string(), 400, "`prompt` must be", Some("prompt")),
        ("/v1/completions", big, 413, "--max-body", None),
        ("/generate", json!({"max_tokens": 3}).to_string(), 400, "`prompt` is required", Some("prompt")),
    ];
    for (path, body, status, text, param) in &cases {
        let r = request(server.port, "POST", path, &[], Some(body.as_bytes()));
        assert_eq!(r.status, *status, "{path} {body:.80}: {}", r.body);
        let err = openai_error(&r);
        assert!(
            err["message"].as_str().is_some_and(|m| m.contains(text)),
            "{path} {body:.80}: {}",
            r.body
        );
        assert_eq!(
            err["param"].as_str(),
            *param,
            "{path} {body:.80}: {}",
            r.body
        );
    }
    let r = server.get("/v1/nothing");
    assert_eq!(r.status, 404);
    openai_error(&r);
    let r = server.get("/v1/completions");
    assert_eq!(r.status, 405);
    openai_error(&r);
    let over = server.post(
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 1000}),
    );
    assert!(
        openai_error(&over)["message"]
            .as_str()
            .is_some_and(|m| m.contains("at most")),
        "{}",
        over.body
    );

    if let Some(out) = openai_client(&server.url(), &["--scenario", "errors"]) {
        assert_eq!(out["unknown_model"]["status"], 404, "{out}");
        assert_eq!(out["unknown_model"]["class"], "NotFoundError");
        assert_eq!(out["empty_messages"]["status"], 400);
        assert_eq!(out["wrong_type"]["status"], 400);
        assert!(
            out["wrong_type"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("temperature")),
            "{out}"
        );
        assert_eq!(out["max_tokens_over_context"]["status"], 400);
    }
    // None of that disturbed the server.
    let ok = server.post(
        "/v1/chat/completions",
        &json!({"messages": user, "max_tokens": 3}),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(server.get("/health").status, 200);
}

/// A copy of a fixture without any chat template.
fn checkpoint_without_template(variant: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "gemma4-serve-no-template-{}-{variant}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(fixture(variant)).expect("fixture") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name").to_owned();
        match name.to_str() {
            Some("chat_template.jinja") => {}
            Some("tokenizer_config.json") => {
                let mut cfg: Value =
                    serde_json::from_str(&std::fs::read_to_string(&path).expect("read"))
                        .expect("json");
                if let Some(obj) = cfg.as_object_mut() {
                    obj.remove("chat_template");
                }
                std::fs::write(dir.join(name), cfg.to_string()).expect("write");
            }
            _ => {
                std::fs::copy(&path, dir.join(name)).expect("copy");
            }
        }
    }
    dir
}

#[test]
fn chat_without_a_template_names_the_chat_template_flag() {
    let dir = checkpoint_without_template("e-style");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    {
        let server = ServerProc::start(&dir, &[], &[]);
        let r = server.post("/v1/chat/completions", &chat);
        assert_eq!(r.status, 400, "{}", r.body);
        let err = openai_error(&r);
        assert!(
            err["message"]
                .as_str()
                .is_some_and(|m| m.contains("--chat-template FILE")),
            "{}",
            r.body
        );
        assert_eq!(err["code"], "chat_template_missing");
        let c = server.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 3}));
        assert_eq!(c.status, 200, "completions still work: {}", c.body);
    }
    let template = fixture("e-style").join("chat_template.jinja");
    let template = template.to_str().expect("utf-8 path");
    let server = ServerProc::start(&dir, &["--chat-template", template], &[]);
    let g = golden("e-style");
    let golden_chat = prompt_named(&g, "chat");
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": golden_chat["messages"], "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["prompt_tokens"], golden_chat["n_tokens"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_model_answers_paris() {
    let Some(gguf) = harness::demo_gguf("demo_model_answers_paris") else {
        return;
    };
    let server = ServerProc::start(&gguf, &["--max-num-seqs", "2"], &[]);
    let stem = gguf
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("file stem")
        .to_string();
    assert_eq!(
        server.get("/v1/models").json()["data"][0]["id"],
        stem.as_str()
    );
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Q: What is the capital of France?\nA:", "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    assert!(text.contains("Paris"), "answer: {text:?}");
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(chat.status, 400);
    assert!(openai_error(&chat)["message"]
        .as_str()
        .is_some_and(|m| m.contains("--chat-template FILE")));
}

#[test]
fn stops_seeds_and_logprobs_follow_the_greedy_reference() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let short = prompt_named(&g, "short");
    let expected = golden_ids(short);
    let reference = generate_ids(&server, &short["input_ids"], 24);
    let full = reference["response"].as_str().expect("text").to_string();
    let completion = |extra: Value| {
        let mut body = json!({"prompt": short["input_ids"], "max_tokens": 24, "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };

    // A stop token id ends the output before that token.
    let out = completion(json!({"stop_token_ids": [expected[2]]}));
    assert_eq!(out["choices"][0]["finish_reason"], "stop");
    let cut = expected
        .iter()
        .position(|&t| t == expected[2])
        .expect("present");
    assert_eq!(out["usage"]["completion_tokens"], cut);

    // A stop string cuts the text right before it.
    let tail: String = full
        .chars()
        .rev()
        .take(3)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let at = full.find(&tail).expect("tail occurs");
    let out = completion(json!({"stop": [tail]}));
    assert_eq!(out["choices"][0]["finish_reason"], "stop");
    assert_eq!(out["choices"][0]["text"], &full[..at]);

    // Greedy log-probabilities: the chosen token is the most likely one.
    let out = completion(json!({"logprobs": 2}));
    let lp = &out["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(24));
    for (chosen, top) in lp["token_logprobs"]
        .as_array()
        .expect("logprobs")
        .iter()
        .zip(lp["top_logprobs"].as_array().expect("top"))
    {
        let best = top
            .as_object()
            .expect("map")
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        assert!(
            (chosen.as_f64().expect("number") - best).abs() < 1e-6,
            "{chosen} vs {top}"
        );
    }
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
    );
    assert_eq!(chat.status, 200, "{}", chat.body);
    let content = chat.json()["choices"][0]["logprobs"]["content"].clone();
    assert_eq!(content.as_array().map(Vec::len), Some(5));
    for entry in content.as_array().expect("content") {
        let top = entry["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        assert_eq!(
            entry["logprob"], top[0]["logprob"],
            "greedy picks the top alternative"
        );
    }

    // The same seed gives the same sample; n choices with a seed differ from each other.
    let sampled = |seed: u64| {
        completion(json!({"temperature": 1.0, "seed": seed, "n": 2}))["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().expect("text").to_string())
            .collect::<Vec<_>>()
    };
    let a = sampled(7);
    assert_eq!(a, sampled(7), "seeded sampling is reproducible");
    assert_ne!(a[0], a[1], "choices of one request use different seeds");
}

/// Every reply and every streamed chunk and event of chat, completions,
/// models and responses (plain, with log-probs, with a forced tool call,
/// with instructions and metadata) validates against the official `openai`
/// SDK's own types, and has the keys the spec requires where the SDK is
/// looser (`tests/python/sdk_conformance.py` lists both ways it differs).
#[test]
fn every_reply_and_event_validates_against_the_openai_sdk_types() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let Some(out) = python_script(
        "sdk_conformance.py",
        &["openai"],
        &["--base-url", &server.url()],
    ) else {
        return;
    };
    assert_eq!(out["problems"], json!([]), "{out}");
    assert!(out["checked"].as_u64() > Some(60), "{out}");
}
