//! Ollama's API through the official `ollama` client: chats whole and
//! streamed (the chunks add up to the whole reply) with a format schema,
//! thinking and tools, a tool round trip by tool name, a templated
//! generation, the model listings, and an unknown model in Ollama's error shape.

use serde_json::{json, Value};

use crate::harness::{fixture, python_script, ServerProc};
use crate::protocol::e_style_opening_a_channel;

#[test]
fn ollama_routes_through_the_ollama_client() {
    let template = e_style_opening_a_channel();
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--chat-template", template.to_str().expect("utf-8 path")],
        &[],
    );
    let url = server.url();
    let args = [
        "--host",
        url.as_str(),
        "--model",
        "e-style",
        "--max-tokens",
        "24",
    ];
    let Some(out) = python_script("ollama_client.py", &["ollama"], &args) else {
        return;
    };
    let _ = std::fs::remove_file(&template);
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    for case in ["plain", "format", "think", "tools"] {
        let (whole, stream) = (&out[case]["whole"], &out[case]["stream"]);
        let message = &whole["message"];
        assert_eq!(
            text(&message["content"]),
            text(&stream["content"]),
            "{case}: {out}"
        );
        assert_eq!(
            text(&message["thinking"]),
            text(&stream["thinking"]),
            "{case}: {out}"
        );
        let calls = message["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(Value::Array(calls), stream["tool_calls"], "{case}: {out}");
        assert_eq!(whole["done_reason"], stream["done_reason"], "{case}: {out}");
        assert_eq!(whole["eval_count"], stream["eval_count"], "{case}: {out}");
        assert_eq!(
            whole["prompt_eval_count"], stream["prompt_eval_count"],
            "{case}: {out}"
        );
        let done: Vec<bool> = stream["done"]
            .as_array()
            .expect("chunks")
            .iter()
            .filter_map(Value::as_bool)
            .collect();
        assert_eq!(done.last(), Some(&true), "{case}: {out}");
        assert!(done[..done.len() - 1].iter().all(|d| !d), "{case}: {out}");
    }
    let answer = text(&out["format"]["whole"]["message"]["content"]);
    let parsed: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"));
    assert!(
        parsed["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 8),
        "{parsed}"
    );
    assert!(
        !text(&out["think"]["whole"]["message"]["thinking"]).is_empty(),
        "{out}"
    );
    assert_eq!(out["round_trip"]["done"], true, "{out}");
    assert_eq!(out["round_trip"]["message"]["role"], "assistant", "{out}");
    let generate = &out["generate"];
    assert_eq!(generate["whole"]["response"], generate["streamed"], "{out}");
    assert_eq!(
        generate["whole"]["done_reason"], generate["done_reason"],
        "{out}"
    );
    let listed = &out["list"]["models"][0];
    assert_eq!(listed["model"], "e-style", "{out}");
    assert_eq!(listed["details"]["format"], "safetensors", "{out}");
    assert!(listed["size"].as_u64() > Some(0), "{out}");
    let capabilities = out["show"]["capabilities"]
        .as_array()
        .expect("capabilities");
    assert!(capabilities.iter().any(|c| c == "completion"), "{out}");
    assert_eq!(out["ps"]["models"][0]["model"], "e-style", "{out}");
    assert!(
        out["ps"]["models"][0]["context_length"].as_u64() > Some(0),
        "{out}"
    );
    // Bad input is a 400 in Ollama's shape, naming the field.
    for (body, field) in [
        (
            json!({"model": "e-style", "messages": [], "format": 5}),
            "format",
        ),
        (
            json!({"model": "e-style", "prompt": "x", "raw": true}),
            "raw",
        ),
        (json!({"messages": []}), "model"),
        (
            json!({"model": "e-style", "messages": [], "options": {"num_ctx": 1_000_000}}),
            "num_ctx",
        ),
    ] {
        let path = if body.get("prompt").is_some() {
            "/api/generate"
        } else {
            "/api/chat"
        };
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let error = r.json()["error"].as_str().unwrap_or_default().to_owned();
        assert!(error.contains(field), "{body}: {}", r.body);
    }
    assert_eq!(out["unknown_model"]["status"], 404, "{out}");
    assert!(
        text(&out["unknown_model"]["error"]).contains("no-such-model"),
        "{out}"
    );
}
