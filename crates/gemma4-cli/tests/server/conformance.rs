//! Points of OpenAI's published spec that a careful client leans on: a
//! nullable or empty `prompt`, `tool_choice` of type `allowed_tools` (chat
//! and responses), and tools other than functions refused by name.

use serde_json::{json, Value};

use crate::harness::{fixture, openai_error, ServerProc};

fn tools() -> Value {
    let zone = json!({"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                      "required": ["zone"]});
    json!([{"type": "function", "function": {"name": "get_time", "parameters": zone}},
           {"type": "function", "function": {"name": "get_date", "parameters": zone}}])
}

#[test]
fn empty_and_null_prompts_are_the_start_of_a_document() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    for prompt in [json!(""), Value::Null] {
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{prompt}: {}", r.body);
        // The prompt is `<bos>` alone.
        assert_eq!(r.json()["usage"]["prompt_tokens"], 1, "{}", r.body);
    }
}

#[test]
fn allowed_tools_limit_the_calls_a_turn_may_make() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let user = json!([{"role": "user", "content": "Date?"}]);
    let choice = json!({"type": "allowed_tools", "allowed_tools": {"mode": "required",
        "tools": [{"type": "function", "function": {"name": "get_date"}}]}});
    for seed in 0..3 {
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": user, "tools": tools(), "tool_choice": choice,
                    "max_tokens": 60, "temperature": 1, "seed": seed}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let calls = r.json()["choices"][0]["message"]["tool_calls"].clone();
        let names: Vec<&str> = calls
            .as_array()
            .map(|c| {
                c.iter()
                    .filter_map(|c| c["function"]["name"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            !names.is_empty(),
            "a required call was not made: {}",
            r.body
        );
        assert!(names.iter().all(|n| *n == "get_date"), "{names:?}");
    }
    // The same through /v1/responses, in its own spelling.
    let r = server.post(
        "/v1/responses",
        &json!({"input": "Date?", "max_output_tokens": 60, "temperature": 0,
                "tools": [{"type": "function", "name": "get_time", "parameters": tools()[0]["function"]["parameters"]},
                          {"type": "function", "name": "get_date", "parameters": tools()[1]["function"]["parameters"]}],
                "tool_choice": {"type": "allowed_tools", "mode": "required",
                                "tools": [{"type": "function", "name": "get_date"}]}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let called: Vec<&Value> = v["output"]
        .as_array()
        .map(|o| o.iter().filter(|i| i["type"] == "function_call").collect())
        .unwrap_or_default();
    assert!(
        !called.is_empty() && called.iter().all(|c| c["name"] == "get_date"),
        "{v}"
    );

    // Bad lists are a 400 naming the field.
    let cases = [
        (
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}),
            "tool_choice.allowed_tools.tools[0]",
        ),
        (
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}),
            "tool_choice.allowed_tools.mode",
        ),
    ];
    for (choice, param) in cases {
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": user, "tools": tools(), "tool_choice": choice, "max_tokens": 4}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(openai_error(&r)["param"], param, "{}", r.body);
    }
}

#[test]
fn tools_other_than_functions_are_refused_by_name() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (tool, param) in [
        (
            json!({"type": "custom", "custom": {"name": "grep"}}),
            "tools[0].type",
        ),
        (
            json!({"type": "function", "function": 0}),
            "tools[0].function.name",
        ),
    ] {
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": user, "tools": [tool], "max_tokens": 4}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        let err = openai_error(&r);
        assert_eq!(err["param"], param, "{}", r.body);
        assert!(
            !r.body.contains("template"),
            "a raw template error: {}",
            r.body
        );
    }
}

#[test]
fn responses_repeat_tools_with_every_required_field() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let tool = json!({"type": "function", "name": "get_time"});
    let r = server.post(
        "/v1/responses",
        &json!({"input": "Time?", "tools": [tool], "max_output_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let echoed = &r.json()["tools"][0];
    assert_eq!(echoed["name"], "get_time");
    // Required by the API, nullable: present even when not sent.
    for field in ["parameters", "strict"] {
        assert!(
            echoed.as_object().is_some_and(|o| o.contains_key(field)),
            "{field} missing: {echoed}"
        );
    }
    let r = server.post(
        "/v1/responses",
        &json!({"input": "Time?", "max_output_tokens": 2,
                "tools": [{"type": "function", "name": "f", "parameters": true}]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(openai_error(&r)["param"], "tools[0].parameters");
}

#[test]
fn responses_errors_name_the_responses_fields() {
    let server = ServerProc::start(&fixture("e-style"), &[], &[]);
    let cases = [
        (json!([{"type": "reasoning", "summary": []}]), "input"),
        (json!([{"role": "robot", "content": "hi"}]), "input[0].role"),
        (
            json!([{"role": "user", "content": "hi"},
                   {"type": "function_call", "call_id": "c1", "name": 7, "arguments": "{}"}]),
            "input[1].name",
        ),
        (
            json!([{"role": "user", "content": "hi"},
                   {"type": "function_call_output", "output": "12:00"}]),
            "input[1].call_id",
        ),
    ];
    let bodies = cases
        .into_iter()
        .map(|(input, param)| (json!({"input": input, "max_output_tokens": 2}), param))
        .chain([
            // Found by the chat path it is served by, named as sent.
            (
                json!({"input": [{"role": "user", "content": "hi"},
                                 {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}],
                       "max_output_tokens": 2}),
                "input[1].arguments",
            ),
            (
                json!({"input": [{"role": "user", "content": [
                           {"type": "input_text", "text": "what is this?"},
                           {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}],
                       "max_output_tokens": 2}),
                "input[0].content[1].image_url",
            ),
            (json!({"input": "hi", "max_output_tokens": 100000}), "max_output_tokens"),
            (
                json!({"input": "hi", "max_output_tokens": 2,
                       "text": {"format": {"type": "json_schema", "name": "n",
                                           "schema": {"type": "array", "uniqueItems": true}}}}),
                "text.format",
            ),
        ]);
    for (body, param) in bodies {
        let r = server.post("/v1/responses", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let err = openai_error(&r);
        assert_eq!(err["param"], param, "{body}: {}", r.body);
        for chat in ["messages", "max_tokens", "response_format", "function."] {
            assert!(!r.body.contains(chat), "a chat field named: {}", r.body);
        }
    }
}
