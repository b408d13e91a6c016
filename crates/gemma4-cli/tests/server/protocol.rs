//! The Gemma 4 protocol through the server and the official `openai` client:
//! reasoning with a thinking budget, tool_choice, the tool round trip.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::harness::{fixture, golden, openai_client, ServerProc};

/// The ids of special tokens in a checkpoint's `tokenizer.json`, as decimal strings.
pub(crate) fn token_ids(checkpoint: &Path, tokens: &[&str]) -> Vec<String> {
    let path = checkpoint.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).expect("tokenizer.json");
    let json: Value = serde_json::from_str(&text).expect("tokenizer JSON");
    let added = json["added_tokens"].as_array().expect("added_tokens");
    tokens
        .iter()
        .map(|token| {
            added
                .iter()
                .find(|t| t["content"] == *token)
                .and_then(|t| t["id"].as_u64())
                .unwrap_or_else(|| panic!("{token} is not in {}", path.display()))
                .to_string()
        })
        .collect()
}

/// A checkpoint's template, but with thinking on the generation prompt opens
/// a thought channel (`find` becomes `replace`), so a random model starts
/// inside it, as it does after a tool response on the large checkpoints.
fn template_opening_a_channel(checkpoint: &Path, find: &str, replace: &str) -> PathBuf {
    let source =
        std::fs::read_to_string(checkpoint.join("chat_template.jinja")).expect("chat template");
    let opened = source.replace(find, replace);
    assert_ne!(opened, source, "the generation prompt was found");
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let path = std::env::temp_dir().join(format!(
        "gemma4-open-channel-{}-{n}.jinja",
        std::process::id()
    ));
    std::fs::write(&path, opened).expect("write template");
    path
}

/// The e-style template opening a channel when thinking.
pub(crate) fn e_style_opening_a_channel() -> PathBuf {
    template_opening_a_channel(
        &fixture("e-style"),
        "{{- '<|turn>model\\n' -}}{%- endif -%}",
        "{{- '<|turn>model\\n' -}}{%- if enable_thinking -%}{{- '<|channel>thought\\n' -}}{%- endif -%}{%- endif -%}",
    )
}

#[test]
fn reasoning_budget_tool_choice_and_round_trip_through_the_openai_client() {
    check_protocol(&fixture("e-style"), &e_style_opening_a_channel());
}

/// Reasoning under a budget of 12 tokens, `tool_choice: "none"` and the tool
/// round trip, served from `checkpoint` with `template`.
fn check_protocol(checkpoint: &Path, template: &Path) {
    let server = ServerProc::start(
        checkpoint,
        &["--chat-template", template.to_str().expect("utf-8 path")],
        &[],
    );
    // Random weights would close or reopen the channel, or call a tool, at
    // random; banning those markers leaves the budget as the only way out.
    let ban = token_ids(checkpoint, &["<|channel>", "<channel|>", "<|tool_call>"]);
    let mut args = vec![
        "--scenario",
        "protocol",
        "--prompt",
        "Think, then answer.",
        "--max-tokens",
        "30",
        "--budget",
        "12",
    ];
    for id in &ban {
        args.extend(["--ban", id.as_str()]);
    }
    let Some(out) = openai_client(&server.url(), &args) else {
        return;
    };
    let _ = std::fs::remove_file(template);
    let whole = &out["whole"];
    assert_eq!(
        whole["usage"]["completion_tokens_details"]["reasoning_tokens"], 12,
        "{out}"
    );
    assert_eq!(whole["usage"]["completion_tokens"], 30, "{out}");
    assert!(
        whole["reasoning"].as_str().is_some_and(|r| !r.is_empty()),
        "the turn starts inside the channel: {out}"
    );
    assert!(
        whole["content"].as_str().is_some_and(|c| !c.is_empty()),
        "the answer follows the forced end of thinking: {out}"
    );
    assert_eq!(whole["finish_reason"], "length");
    assert!(whole["system_fingerprint"]
        .as_str()
        .is_some_and(|f| f.starts_with("gemma4-")));
    let stream = &out["stream"];
    assert_eq!(stream["content"], whole["content"], "{out}");
    assert_eq!(stream["reasoning"], whole["reasoning"], "{out}");
    assert_eq!(stream["finish_reason"], whole["finish_reason"]);
    assert_eq!(stream["usage"], whole["usage"]);

    assert_eq!(out["tool_choice_none"]["tool_calls"], 0);
    assert!(
        out["round_trip"]["finish_reason"].is_string(),
        "an assistant tool call with string arguments and a tool message are accepted: {out}"
    );
    let required = &out["required"];
    assert_eq!(required["status"], 400, "{out}");
    assert_eq!(required["body"]["param"], "tool_choice", "{out}");
}

#[test]
fn tokenize_detokenize_and_model_card() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let g = golden("e-style");
    let chat = g["prompts"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "chat"))
        .expect("golden chat prompt");
    // Messages are rendered exactly as chat completions render them: the oracle's ids.
    let r = server.post("/tokenize", &json!({"messages": chat["messages"]}));
    assert_eq!(r.status, 200, "{}", r.body);
    let t = r.json();
    assert_eq!(t["tokens"], chat["input_ids"]);
    assert_eq!(
        t["count"],
        chat["input_ids"].as_array().map(Vec::len).unwrap_or(0)
    );
    assert!(t["max_model_len"].as_u64().is_some_and(|n| n > 0));

    let r = server.post("/detokenize", &json!({"tokens": chat["input_ids"]}));
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["prompt"].as_str().expect("prompt").to_owned();
    let back = server.post(
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    assert_eq!(
        back.json()["tokens"],
        chat["input_ids"],
        "round trip of {text:?}"
    );
    let bad = server.post("/detokenize", &json!({"tokens": [99999999]}));
    assert_eq!(bad.status, 400);

    let card = server.get("/v1/models/e-style");
    assert_eq!(card.status, 200, "{}", card.body);
    assert_eq!(card.json()["id"], "e-style");
    assert_eq!(server.get("/v1/models/other").status, 404);
}

/// One call each, through the `openai` client with `parallel_tool_calls=False`,
/// whose arguments validate against the schema the client sent.
fn check_forced_schemas(out: &Value) {
    let tools = out["tools"].as_array().expect("the tools sent");
    for case in ["named", "required"] {
        let r = &out["forced"][case];
        assert_eq!(r["finish_reason"], "tool_calls", "{case}: {out}");
        let calls = r["calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1, "{case}: {out}");
        let name = calls[0]["name"].as_str().unwrap_or_default();
        if case == "named" {
            assert_eq!(name, "set_budget");
        }
        let schema = &tools
            .iter()
            .find(|t| t["function"]["name"] == name)
            .unwrap_or_else(|| panic!("{case}: unknown tool {name}"))["function"]["parameters"];
        let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{case}: arguments are not JSON ({e}): {out}"));
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(schema)
            .expect("the client's schema compiles");
        let errors: Vec<String> = validator
            .iter_errors(&args)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{case}: {args} breaks {schema}: {errors:?}"
        );
    }
}

/// The weather arguments the test schema allows.
fn valid_weather(v: &Value) -> bool {
    let Some(obj) = v.as_object() else {
        return false;
    };
    obj.keys()
        .all(|k| ["city", "days", "unit"].contains(&k.as_str()))
        && v["city"].as_str().is_some_and(|c| c.chars().count() <= 12)
        && (v["unit"] == "c" || v["unit"] == "f")
        && v.get("days")
            .is_none_or(|d| d.as_i64().is_some_and(|d| (1..=9).contains(&d)))
}

#[test]
fn enforced_structured_output_is_valid_even_from_random_weights() {
    let template = e_style_opening_a_channel();
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--chat-template", template.to_str().expect("utf-8 path")],
        &[],
    );
    let ban = token_ids(&fixture("e-style"), &["<|channel>", "<channel|>"]);
    let mut args = vec![
        "--scenario",
        "structured",
        "--prompt",
        "Weather in Paris?",
        "--max-tokens",
        "120",
        "--budget",
        "12",
    ];
    for id in &ban {
        args.extend(["--ban", id.as_str()]);
    }
    let Some(out) = openai_client(&server.url(), &args) else {
        return;
    };
    let _ = std::fs::remove_file(&template);
    check_structured(&out, true);
}

/// Every enforced output of the `structured` scenario is valid.
fn check_structured(out: &Value, expect_reasoning: bool) {
    for thinking in [false, true] {
        let r = &out[format!("json_schema_thinking_{thinking}")];
        let content = r["content"].as_str().unwrap_or_default();
        let v: Value = serde_json::from_str(content).unwrap_or_else(|e| {
            panic!("thinking {thinking}: {content:?} is not JSON ({e}): {out}")
        });
        assert!(valid_weather(&v), "thinking {thinking}: {v}");
        assert_eq!(r["finish_reason"], "stop", "{out}");
        if thinking && expect_reasoning {
            assert!(
                r["reasoning"].as_str().is_some_and(|t| !t.is_empty()),
                "free reasoning first, then the enforced answer: {out}"
            );
        }
    }
    let obj = out["json_object"]["content"].as_str().unwrap_or_default();
    assert!(
        serde_json::from_str::<Value>(obj).is_ok_and(|v| v.is_object()),
        "json_object: {obj:?}"
    );
    let tools = &out["tools"];
    for case in ["required", "named"] {
        let r = &tools[case];
        assert_eq!(r["finish_reason"], "tool_calls", "{case}: {out}");
        let calls = r["calls"].as_array().expect("calls");
        assert!(!calls.is_empty(), "{case}: {out}");
        for call in calls {
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()));
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or_default())
                .unwrap_or_else(|e| panic!("{case}: arguments are not JSON ({e}): {out}"));
            match call["name"].as_str() {
                Some("get_weather") => assert!(valid_weather(&args), "{case}: {args}"),
                Some("get_time") => {
                    assert!(
                        args["zone"] == "utc" || args["zone"] == "cet",
                        "{case}: {args}"
                    )
                }
                other => panic!("{case}: unknown tool {other:?}"),
            }
        }
        if case == "named" {
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0]["name"], "get_time");
        }
    }
    check_forced_schemas(&out["schemas"]);
    let streamed = &tools["required_stream"];
    assert_eq!(streamed["finish_reason"], "tool_calls");
    let whole: Vec<(Value, Value)> = tools["required"]["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| (c["name"].clone(), c["arguments"].clone()))
        .collect();
    let parts: Vec<(Value, Value)> = streamed["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| (c["name"].clone(), c["arguments"].clone()))
        .collect();
    assert_eq!(
        parts, whole,
        "streamed names and argument deltas concatenate to the whole"
    );
    let choice = out["guided_choice"].as_str().unwrap_or_default();
    assert!(choice == "alpha" || choice == "beta", "{choice:?}");
    let bad = &out["uncompilable"];
    assert_eq!(bad["status"], 400, "{out}");
    assert!(
        bad["message"]
            .as_str()
            .is_some_and(|m| m.contains("uniqueItems")),
        "{out}"
    );
}

#[test]
fn enforced_output_with_the_real_vocabulary_and_template() {
    let server = ServerProc::start(crate::real_vocab::dir(), &[], &[]);
    let args = [
        "--scenario",
        "structured",
        "--prompt",
        "Weather in Paris?",
        "--max-tokens",
        "120",
        "--budget",
        "12",
    ];
    let Some(out) = openai_client(&server.url(), &args) else {
        return;
    };
    // The checkpoint's template does not open a channel for the model, so
    // whether a random model thinks first is up to it; the answer is enforced either way.
    check_structured(&out, false);
}

#[test]
fn reasoning_budget_and_tool_choice_with_the_real_vocabulary_and_template() {
    let dir = crate::real_vocab::dir();
    let template = template_opening_a_channel(
        dir,
        "{%- if not enable_thinking | default(false) -%}\n            {{- '<|channel>thought\\n<channel|>' -}}\n        {%- endif -%}",
        "{%- if not enable_thinking | default(false) -%}\n            {{- '<|channel>thought\\n<channel|>' -}}\n        {%- else -%}{{- '<|channel>thought\\n' -}}\n        {%- endif -%}",
    );
    check_protocol(dir, &template);
}

#[test]
fn responses_api_returns_typed_output_items() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"], "additionalProperties": false});
    let r = server.post(
        "/v1/responses",
        &json!({"input": "Weather?", "max_output_tokens": 60, "temperature": 0,
                "text": {"format": {"type": "json_schema", "name": "w", "schema": schema}}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed", "{v}");
    let message = v["output"]
        .as_array()
        .and_then(|o| o.iter().find(|i| i["type"] == "message"))
        .unwrap_or_else(|| panic!("no message item: {v}"));
    let text = message["content"][0]["text"].as_str().unwrap_or_default();
    let answer: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        answer["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 8),
        "{answer}"
    );
    assert!(v["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0));

    let tools = json!([{"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                       "required": ["zone"]}}]);
    let r = server.post(
        "/v1/responses",
        &json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Time?"}]}],
                "tools": tools, "tool_choice": {"type": "function", "name": "get_time"},
                "max_output_tokens": 60, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls: Vec<&Value> = v["output"]
        .as_array()
        .map(|o| o.iter().filter(|i| i["type"] == "function_call").collect())
        .unwrap_or_default();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["name"], "get_time");
    let args: Value =
        serde_json::from_str(calls[0]["arguments"].as_str().unwrap_or_default()).expect("JSON");
    assert!(args["zone"] == "utc" || args["zone"] == "cet", "{args}");
    let call_id = calls[0]["call_id"].clone();

    let r = server.post(
        "/v1/responses",
        &json!({"input": [
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": call_id, "name": "get_time", "arguments": args.to_string()},
            {"type": "function_call_output", "call_id": call_id, "output": "12:00"}],
            "tools": tools, "max_output_tokens": 4}),
    );
    assert_eq!(r.status, 200, "the tool round trip is accepted: {}", r.body);
    let r = server.post(
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": "resp_1"}),
    );
    assert_eq!(r.status, 400);
}

#[test]
fn responses_api_streams_what_it_answers_whole() {
    let template = e_style_opening_a_channel();
    let server = ServerProc::start(
        &fixture("e-style"),
        &["--chat-template", template.to_str().expect("utf-8 path")],
        &[],
    );
    let ban = token_ids(
        &fixture("e-style"),
        &["<|channel>", "<channel|>", "<|tool_call>"],
    );
    let mut args = vec![
        "--scenario",
        "responses",
        "--prompt",
        "Time in Paris?",
        "--max-tokens",
        "40",
        "--budget",
        "12",
    ];
    for id in &ban {
        args.extend(["--ban", id.as_str()]);
    }
    let Some(out) = openai_client(&server.url(), &args) else {
        return;
    };
    let _ = std::fs::remove_file(&template);
    for case in ["json_schema", "named_call", "thinking"] {
        let r = &out[case];
        let (whole, stream, helper) = (&r["whole"], &r["stream"], &r["helper"]);
        assert_eq!(stream["output"], whole["output"], "{case}: {r}");
        assert_eq!(helper["output"], whole["output"], "{case}: {r}");
        assert_eq!(stream["status"], whole["status"], "{case}: {r}");
        assert_eq!(helper["status"], whole["status"], "{case}: {r}");
        // The cached-token counts depend on which ran first; the rest is equal.
        let counts = |usage: &Value| {
            let mut usage = usage.clone();
            if let Some(d) = usage["input_tokens_details"].as_object_mut() {
                d.remove("cached_tokens");
                d.remove("cache_write_tokens");
            }
            usage
        };
        assert_eq!(
            counts(&stream["usage"]),
            counts(&whole["usage"]),
            "{case}: {r}"
        );
        assert!(
            whole["usage"]["input_tokens_details"]["cached_tokens"].is_u64(),
            "{case}: {r}"
        );
        let types: Vec<&str> = stream["types"]
            .as_array()
            .expect("types")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(types.first(), Some(&"response.created"), "{case}: {r}");
        assert!(
            matches!(
                types.last(),
                Some(&"response.completed" | &"response.incomplete")
            ),
            "{case}: {r}"
        );
        let numbers: Vec<u64> = stream["sequence_numbers"]
            .as_array()
            .expect("numbers")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(numbers, (0..types.len() as u64).collect::<Vec<_>>());
    }
    let text = out["json_schema"]["whole"]["output_text"]
        .as_str()
        .unwrap_or_default();
    let answer: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        answer["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 8),
        "{answer}"
    );
    let calls: Vec<&Value> = out["named_call"]["whole"]["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{out}");
    assert_eq!(calls[0]["name"], "get_time");
    let args: Value =
        serde_json::from_str(calls[0]["arguments"].as_str().unwrap_or_default()).expect("JSON");
    assert!(args["zone"] == "utc" || args["zone"] == "cet", "{args}");
    let thinking = &out["thinking"]["whole"];
    assert_eq!(
        thinking["usage"]["output_tokens_details"]["reasoning_tokens"], 12,
        "{thinking}"
    );
    let first = &thinking["output"][0];
    assert_eq!(first["type"], "reasoning", "{thinking}");
    assert!(
        first["content"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{thinking}"
    );
    assert!(
        thinking["output"]
            .as_array()
            .is_some_and(|items| items.iter().any(|i| i["type"] == "message")),
        "the answer follows the thought: {thinking}"
    );
}
