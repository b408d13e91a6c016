//! Anthropic's Messages API through the official `anthropic` SDK: whole,
//! streamed and through the SDK's stream helper (all three the same
//! message), structured output, forced and free tool calls, thinking under a
//! budget, a tool round trip, the SDK's tool-runner agent loop, token
//! counting, and errors in Anthropic's shape.

use serde_json::{json, Value};

use crate::harness::{fixture, python_script, ServerProc};
use crate::images::{chat_golden_of, fixture_of};
use crate::protocol::{e_style_opening_a_channel, token_ids};

const KEY: &str = "k-anthropic";

fn run(server: &ServerProc, scenario: &str, extra: &[&str]) -> Option<Value> {
    let url = server.url();
    let mut args = vec![
        "--base-url",
        url.as_str(),
        "--model",
        "e-style",
        "--scenario",
        scenario,
        "--api-key",
        KEY,
    ];
    args.extend_from_slice(extra);
    python_script("anthropic_client.py", &["anthropic"], &args)
}

/// Content blocks without their call ids (each request numbers its own).
fn without_ids(content: &Value) -> Value {
    let mut content = content.clone();
    for block in content.as_array_mut().into_iter().flatten() {
        if let Some(b) = block.as_object_mut() {
            b.remove("id");
        }
    }
    content
}

fn blocks<'a>(message: &'a Value, kind: &str) -> Vec<&'a Value> {
    message["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == kind)
        .collect()
}

#[test]
fn messages_through_the_anthropic_sdk() {
    let template = e_style_opening_a_channel();
    let server = ServerProc::start(
        &fixture("e-style"),
        &[
            "--chat-template",
            template.to_str().expect("utf-8 path"),
            "--api-key",
            KEY,
        ],
        &[],
    );
    // Random weights would leave the thought channel, or call a tool, at
    // random; banning those markers leaves the budget as the only way out.
    let ban = token_ids(
        &fixture("e-style"),
        &["<|channel>", "<channel|>", "<|tool_call>"],
    );
    let mut extra = vec!["--budget", "12"];
    for id in &ban {
        extra.extend(["--ban", id.as_str()]);
    }
    let Some(out) = run(&server, "messages", &extra) else {
        return;
    };
    for case in ["plain", "json_schema", "named_call", "any_call", "thinking"] {
        let r = &out[case];
        let (whole, stream, helper) = (&r["whole"], &r["stream"], &r["helper"]);
        assert_eq!(
            without_ids(&helper["content"]),
            without_ids(&whole["content"]),
            "{case}: {r}"
        );
        assert_eq!(helper["stop_reason"], whole["stop_reason"], "{case}: {r}");
        assert_eq!(stream["stop_reason"], whole["stop_reason"], "{case}: {r}");
        assert_eq!(
            stream["output_tokens"], whole["usage"]["output_tokens"],
            "{case}: {r}"
        );
        let types: Vec<&str> = stream["types"]
            .as_array()
            .expect("types")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(types.first(), Some(&"message_start"), "{case}: {r}");
        assert_eq!(types.last(), Some(&"message_stop"), "{case}: {r}");
        assert!(
            whole["usage"]["input_tokens"].as_u64() > Some(0),
            "{case}: {r}"
        );
    }
    let answer = &out["json_schema"]["whole"];
    let text = blocks(answer, "text")[0]["text"]
        .as_str()
        .unwrap_or_default();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        parsed["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 8),
        "{parsed}"
    );
    let named = &out["named_call"]["whole"];
    let calls = blocks(named, "tool_use");
    assert_eq!(calls.len(), 1, "{named}");
    assert_eq!(calls[0]["name"], "get_time");
    assert!(
        calls[0]["input"]["zone"] == "utc" || calls[0]["input"]["zone"] == "cet",
        "{named}"
    );
    assert_eq!(named["stop_reason"], "tool_use");
    let any = &out["any_call"]["whole"];
    assert_eq!(
        blocks(any, "tool_use").len(),
        1,
        "one call when parallel use is off: {any}"
    );
    assert_eq!(any["stop_reason"], "tool_use");
    let thinking = &out["thinking"]["whole"];
    assert_eq!(thinking["content"][0]["type"], "thinking", "{thinking}");
    assert!(
        !thinking["content"][0]["thinking"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{thinking}"
    );
    let stopped = &out["stopped"];
    assert_eq!(stopped["whole"]["stop_reason"], "stop_sequence", "{out}");
    assert_eq!(stopped["whole"]["stop_sequence"], stopped["stop"], "{out}");
    let cut: String = blocks(&stopped["whole"], "text")
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    let plain = stopped["plain"].as_str().expect("the plain reply");
    let stop = stopped["stop"].as_str().expect("the stop sequence");
    // White space before the first text is held until text follows it.
    let before = &plain[..plain.find(stop).expect("the stop is in the reply")];
    assert_eq!(cut.trim_start(), before.trim_start(), "{out}");
    // Counting the same prompt gives what the turn was charged.
    assert_eq!(
        out["count_tokens"], out["plain"]["whole"]["usage"]["input_tokens"],
        "{out}"
    );
    let _ = std::fs::remove_file(&template);

    let Some(trip) = run(&server, "round_trip", &[]) else {
        return;
    };
    assert_eq!(trip["first"]["stop_reason"], "tool_use", "{trip}");
    assert_eq!(blocks(&trip["first"], "tool_use")[0]["name"], "get_weather");
    assert!(trip["second"]["stop_reason"].is_string(), "{trip}");
    assert_eq!(
        trip["counted"], trip["second"]["usage"]["input_tokens"],
        "{trip}"
    );

    // The SDK's own agent loop: each turn calls a declared tool, which the
    // loop runs and answers, up to its three iterations.
    let Some(agent) = run(&server, "agent", &["--max-tokens", "60"]) else {
        return;
    };
    let turns = agent["turns"].as_array().expect("turns");
    assert_eq!(turns.len(), 3, "{agent}");
    assert!(
        turns.iter().all(|t| t["stop_reason"] == "tool_use"),
        "{agent}"
    );
    let called = agent["called"].as_array().expect("called");
    assert_eq!(called.len(), 3, "{agent}");
    for call in called {
        let ok = (call[0] == "get_weather" && (call[1] == "Paris" || call[1] == "Rome"))
            || (call[0] == "get_time" && (call[1] == "utc" || call[1] == "cet"));
        assert!(ok, "{agent}");
    }

    let Some(errors) = run(&server, "errors", &[]) else {
        return;
    };
    for (case, status, kind) in [
        ("bad_role", 400, "invalid_request_error"),
        ("bad_model", 404, "not_found_error"),
        ("bad_key", 401, "authentication_error"),
    ] {
        let e = &errors[case];
        assert_eq!(e["status"], status, "{case}: {errors}");
        assert_eq!(e["body"]["type"], "error", "{case}: {errors}");
        assert_eq!(e["body"]["error"]["type"], kind, "{case}: {errors}");
        let message = e["body"]["error"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{case}: {errors}");
    }
    assert!(
        errors["bad_role"]["body"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("messages[0].role")),
        "{errors}"
    );
}

/// An image block (and an Ollama message's `images`) reads as the chat
/// route's `image_url` part does: the reply to the vision fixture's
/// two-image turn is the reference's greedy text, and the prompt is the
/// reference's length, counted and charged.
#[test]
fn image_blocks_keep_the_reference_tokens() {
    let dir = fixture_of("e-style");
    let golden = chat_golden_of("e-style");
    let server = ServerProc::start(&dir, &["--max-soft-tokens", "70"], &[]);
    // A reply's text never holds the thought-channel or tool-declaration
    // markers (the output processor reads them out).
    let marker = |m: &str| {
        server
            .post(
                "/tokenize",
                &json!({"prompt": m, "add_special_tokens": false}),
            )
            .json()["tokens"][0]
            .clone()
    };
    let markers = ["<channel|>", "<|channel>", "<|tool>", "<tool|>"].map(marker);
    let greedy: Vec<&Value> = golden["greedy"]
        .as_array()
        .expect("greedy")
        .iter()
        .filter(|id| !markers.contains(id))
        .collect();
    let expected = server.post("/detokenize", &json!({"tokens": greedy}));
    assert_eq!(expected.status, 200, "{}", expected.body);
    let expected = expected.json()["prompt"].as_str().expect("text").to_owned();
    let paths: Vec<String> = golden["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|i| dir.join(format!("../images/{i}.png")).display().to_string())
        .collect();
    let url = server.url();
    let mut args = vec![
        "--base-url",
        url.as_str(),
        "--model",
        "e-style",
        "--scenario",
        "image",
        "--prompt",
        golden["messages_text"].as_str().expect("text"),
        "--max-tokens",
        "12",
    ];
    for p in &paths {
        args.extend(["--image", p.as_str()]);
    }
    let Some(out) = python_script("anthropic_client.py", &["anthropic"], &args) else {
        return;
    };
    let text: String = blocks(&out["whole"], "text")
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(text, expected, "{out}");
    assert_eq!(out["streamed"], expected.as_str(), "{out}");
    let prompt_tokens = golden["ids"].as_array().expect("ids").len() as u64;
    assert_eq!(
        out["whole"]["usage"]["input_tokens"], prompt_tokens,
        "{out}"
    );
    assert_eq!(out["counted"], prompt_tokens, "{out}");

    // The same turn through Ollama's client, its images as files.
    let mut args = vec![
        "--host",
        url.as_str(),
        "--model",
        "e-style",
        "--prompt",
        golden["messages_text"].as_str().expect("text"),
        "--max-tokens",
        "12",
    ];
    for p in &paths {
        args.extend(["--image", p.as_str()]);
    }
    let Some(out) = python_script("ollama_client.py", &["ollama"], &args) else {
        return;
    };
    assert_eq!(out["content"], expected.as_str(), "{out}");
    assert_eq!(out["streamed"], expected.as_str(), "{out}");
    assert_eq!(out["prompt_eval_count"], prompt_tokens, "{out}");
}

/// Agents on the real-vocabulary checkpoint (Gemma 4's real tokenizer and
/// chat template): the anthropic SDK's tool-runner loop with two tools, and
/// Ollama's client with tools and a tool round trip; every turn parses.
#[test]
fn agents_run_on_the_real_vocabulary_checkpoint() {
    let dir = crate::real_vocab::dir();
    let server = ServerProc::start(dir, &[], &[]);
    let model = server.get("/v1/models").json()["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_owned();
    let url = server.url();
    let args = [
        "--base-url",
        url.as_str(),
        "--model",
        model.as_str(),
        "--scenario",
        "agent",
        "--max-tokens",
        "60",
    ];
    let Some(agent) = python_script("anthropic_client.py", &["anthropic"], &args) else {
        return;
    };
    let turns = agent["turns"].as_array().expect("turns");
    assert!(!turns.is_empty(), "{agent}");
    for (turn, call) in turns
        .iter()
        .zip(agent["called"].as_array().expect("called"))
    {
        let uses = blocks(turn, "tool_use");
        assert_eq!(uses.len(), 1, "{agent}");
        assert_eq!(uses[0]["name"], call[0], "{agent}");
        assert_eq!(turn["stop_reason"], "tool_use", "{agent}");
    }
    let args = [
        "--host",
        url.as_str(),
        "--model",
        model.as_str(),
        "--max-tokens",
        "24",
    ];
    let Some(out) = python_script("ollama_client.py", &["ollama"], &args) else {
        return;
    };
    assert_eq!(out["tools"]["whole"]["done"], true, "{out}");
    assert_eq!(out["round_trip"]["done"], true, "{out}");
}
