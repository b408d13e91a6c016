//! Property tests of request parsing on every API (OpenAI's, Anthropic's,
//! Ollama's): arbitrary bytes, and JSON objects whose known fields hold
//! values of any type, never panic and are either accepted or refused with
//! a 4xx that says why.

use gemma4_server::openai::{ChatRequest, CompletionRequest, GenerateRequest};
use gemma4_server::{anthropic, ollama, ApiError};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Any JSON value, nested a little.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        any::<u64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((".{0,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "user",
    "chat_template_kwargs",
    "tools",
    "ignore_eos",
    "stop_token_ids",
    "response_format",
    "echo",
    "suffix",
    "tool_choice",
    "logit_bias",
    // Anthropic's.
    "system",
    "stop_sequences",
    "thinking",
    "output_config",
    "metadata",
    // Ollama's.
    "options",
    "format",
    "think",
    "images",
    "raw",
    "keep_alive",
];

/// An object with some of the known fields, each holding anything.
fn request_object() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((prop::sample::select(FIELDS), value()), 0..8).prop_map(|fields| {
        let object: Map<String, Value> = fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        Value::Object(object).to_string().into_bytes()
    })
}

fn check(result: Result<(), ApiError>) -> Result<(), TestCaseError> {
    if let Err(e) = result {
        prop_assert!(
            e.status.is_client_error(),
            "status {}: {}",
            e.status,
            e.message
        );
        prop_assert!(!e.message.is_empty());
    }
    Ok(())
}

fn parse_all(body: &[u8]) -> Result<(), TestCaseError> {
    check(ChatRequest::parse(body).map(drop))?;
    check(CompletionRequest::parse(body).map(drop))?;
    check(GenerateRequest::parse(body).map(drop))?;
    check(anthropic::chat_request(body).map(drop))?;
    check(ollama::chat_request(body, false, 512).map(drop))?;
    check(ollama::chat_request(body, true, 512).map(drop))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(body in prop::collection::vec(any::<u8>(), 0..256)) {
        parse_all(&body)?;
    }

    #[test]
    fn known_fields_of_any_type_are_refused_cleanly(body in request_object()) {
        parse_all(&body)?;
    }

    #[test]
    fn hostile_messages_parse_or_are_refused(
        roles in prop::collection::vec(".{0,10}", 1..6),
        contents in prop::collection::vec(value(), 1..6),
    ) {
        let messages: Vec<Value> = roles
            .iter()
            .zip(&contents)
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let body = json!({"messages": messages}).to_string();
        check(ChatRequest::parse(body.as_bytes()).map(drop))?;
        check(anthropic::chat_request(body.as_bytes()).map(drop))?;
        check(ollama::chat_request(body.as_bytes(), false, 512).map(drop))?;
    }
}
