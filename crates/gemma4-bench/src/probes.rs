//! Capability probes: tool calling, structured output and reasoning through
//! `/v1/chat/completions`, each judged by the explicit rules below (no model
//! grades another).
//!
//! An HTTP error is a `fail` with the status and message recorded; a server that
//! cannot be reached leaves the probe `not_tested`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::client::{snippet, CallError, Endpoint};
use crate::report::{Capability, Probe, Verdict};
use crate::schema::Validator;
use crate::stats::round;

/// Text that only appears when a template's tool-call or thinking syntax leaks
/// into `content` instead of being parsed out.
const LEAK_MARKERS: &[&str] = &[
    "<|tool_call",
    "<tool_call|>",
    "tool_call>",
    "<|channel",
    "<channel|>",
    "<think>",
    "</think>",
    "<|think",
    "<start_function_call>",
];

/// The underspecified request: no city is given.
const UNDERSPECIFIED: &str = "What's the weather like right now?";

/// One chat answer, reduced to what the rules look at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatReply {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
    pub completion_tokens: Option<u32>,
    /// `choices[0].finish_reason` (`length` when `max_tokens` ran out).
    pub finish_reason: Option<String>,
}

/// A tool call: its function name and its arguments (parsed, or the raw text
/// when they are not JSON).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Result<Value, String>,
}

impl ToolCall {
    fn string_arg(&self, key: &str) -> Option<String> {
        self.arguments
            .as_ref()
            .ok()?
            .get(key)?
            .as_str()
            .map(str::to_owned)
    }
}

/// Reads `choices[0].message` of a chat completion.
pub fn parse_reply(value: &Value) -> Result<ChatReply, String> {
    let message = value
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("message"))
        .ok_or_else(|| format!("no choices[0].message in {}", snippet(&value.to_string())))?;
    let text = |key: &str| {
        message
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let mut reasoning = text("reasoning_content");
    if reasoning.is_empty() {
        reasoning = text("reasoning");
    }
    let tool_calls = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|call| {
                    let function = call.get("function").unwrap_or(&Value::Null);
                    let name = function
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned();
                    let arguments = match function.get("arguments") {
                        Some(Value::String(raw)) => {
                            serde_json::from_str(raw).map_err(|_| raw.clone())
                        }
                        Some(other @ Value::Object(_)) => Ok(other.clone()),
                        Some(other) => Err(other.to_string()),
                        None => Err(String::new()),
                    };
                    ToolCall { name, arguments }
                })
                .collect()
        })
        .unwrap_or_default();
    let completion_tokens = value
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok());
    let finish_reason = value
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("finish_reason"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    Ok(ChatReply {
        content: text("content"),
        reasoning,
        tool_calls,
        completion_tokens,
        finish_reason,
    })
}

fn leaks(text: &str) -> bool {
    LEAK_MARKERS.iter().any(|m| text.contains(m))
}

fn quote(text: &str) -> String {
    let s = snippet(text);
    let short: String = s.chars().take(80).collect();
    if short.len() < s.len() {
        format!("\"{short}…\"")
    } else {
        format!("\"{short}\"")
    }
}

fn calls_summary(calls: &[ToolCall]) -> String {
    calls
        .iter()
        .map(|c| match &c.arguments {
            Ok(args) => format!("{}({args})", c.name),
            Err(raw) => format!("{}(unparsable: {})", c.name, snippet(raw)),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn weather_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city"]
            }
        }
    })
}

/// simple-call: one correct `get_weather` call for Paris.
pub fn judge_simple_call(r: &ChatReply) -> (Verdict, String) {
    match r.tool_calls.as_slice() {
        [] if leaks(&r.content) || r.content.contains("get_weather") => (
            Verdict::Partial,
            format!(
                "call written into content, not tool_calls: {}",
                quote(&r.content)
            ),
        ),
        [] => (
            Verdict::Fail,
            format!("no tool call; answered {}", quote(&r.content)),
        ),
        [call] if call.name != "get_weather" => (
            Verdict::Fail,
            format!("called the wrong tool: {}", calls_summary(&r.tool_calls)),
        ),
        [call] if call.arguments.is_err() => (
            Verdict::Partial,
            format!("arguments are not JSON: {}", calls_summary(&r.tool_calls)),
        ),
        [call] => match call.string_arg("city") {
            Some(city) if city.to_lowercase().contains("paris") => {
                let unit = match call.string_arg("unit").as_deref() {
                    Some("celsius") => "unit=celsius inferred from the phrasing",
                    Some(_) => "unit set, but not to the requested celsius",
                    None => "optional unit left out",
                };
                (Verdict::Pass, format!("get_weather(city={city}); {unit}"))
            }
            _ => (
                Verdict::Partial,
                format!(
                    "right tool, wrong or missing city: {}",
                    calls_summary(&r.tool_calls)
                ),
            ),
        },
        _ => (
            Verdict::Partial,
            format!(
                "{} calls for one question: {}",
                r.tool_calls.len(),
                calls_summary(&r.tool_calls)
            ),
        ),
    }
}

/// result-synthesis: after the tool result (18 °C, sunny), a plain answer that uses it.
pub fn judge_result_synthesis(r: &ChatReply) -> (Verdict, String) {
    if !r.tool_calls.is_empty() {
        return (
            Verdict::Fail,
            format!(
                "called a tool again instead of answering: {}",
                calls_summary(&r.tool_calls)
            ),
        );
    }
    if r.content.trim().is_empty() {
        return (
            Verdict::Fail,
            "empty answer after the tool result".to_owned(),
        );
    }
    if leaks(&r.content) {
        return (
            Verdict::Partial,
            format!("answer contains template markup: {}", quote(&r.content)),
        );
    }
    if r.content.contains("18") {
        (
            Verdict::Pass,
            format!(
                "natural-language answer uses the tool result: {}",
                quote(&r.content)
            ),
        )
    } else {
        (
            Verdict::Partial,
            format!(
                "answered without the tool's figure (18): {}",
                quote(&r.content)
            ),
        )
    }
}

/// no-tool-restraint: "2 + 2" is answered directly, with no call.
pub fn judge_no_tool_restraint(r: &ChatReply) -> (Verdict, String) {
    if !r.tool_calls.is_empty() {
        return (
            Verdict::Fail,
            format!("spurious tool call: {}", calls_summary(&r.tool_calls)),
        );
    }
    if r.content.trim().is_empty() {
        return (Verdict::Fail, "empty answer".to_owned());
    }
    if leaks(&r.content) || r.content.contains("get_weather") {
        return (
            Verdict::Partial,
            format!(
                "no tool_calls, but call syntax in content: {}",
                quote(&r.content)
            ),
        );
    }
    if r.content.contains('4') {
        (
            Verdict::Pass,
            format!("answered directly, no tool call: {}", quote(&r.content)),
        )
    } else {
        (
            Verdict::Partial,
            format!(
                "no tool call, but the answer lacks 4: {}",
                quote(&r.content)
            ),
        )
    }
}

/// parallel-calls: two `get_weather` calls, Paris and Tokyo, in one turn.
pub fn judge_parallel_calls(r: &ChatReply) -> (Verdict, String) {
    let cities: Vec<String> = r
        .tool_calls
        .iter()
        .filter(|c| c.name == "get_weather")
        .filter_map(|c| c.string_arg("city"))
        .map(|c| c.to_lowercase())
        .collect();
    let paris = cities.iter().any(|c| c.contains("paris"));
    let tokyo = cities.iter().any(|c| c.contains("tokyo"));
    match r.tool_calls.len() {
        0 if leaks(&r.content) || r.content.contains("get_weather") => (
            Verdict::Partial,
            format!(
                "calls written into content, not tool_calls: {}",
                quote(&r.content)
            ),
        ),
        0 => (
            Verdict::Fail,
            format!("no tool call; answered {}", quote(&r.content)),
        ),
        1 => (
            Verdict::Partial,
            format!(
                "only one call in the turn: {}",
                calls_summary(&r.tool_calls)
            ),
        ),
        n if paris && tokyo => (
            Verdict::Pass,
            format!(
                "{n} calls in one turn, one per city: {}",
                calls_summary(&r.tool_calls)
            ),
        ),
        n => (
            Verdict::Partial,
            format!(
                "{n} calls, but not Paris and Tokyo each: {}",
                calls_summary(&r.tool_calls)
            ),
        ),
    }
}

/// underspecified: no city given, so the model should ask rather than invent one.
pub fn judge_underspecified(r: &ChatReply) -> (Verdict, String) {
    if let Some(call) = r.tool_calls.first() {
        return match call.string_arg("city") {
            Some(city) if !city.trim().is_empty() => (
                Verdict::Fail,
                format!(
                    "invented a city and called: {}",
                    calls_summary(&r.tool_calls)
                ),
            ),
            _ => (
                Verdict::Partial,
                format!("called without a city: {}", calls_summary(&r.tool_calls)),
            ),
        };
    }
    let lower = r.content.to_lowercase();
    if lower.trim().is_empty() {
        return (Verdict::Fail, "empty answer".to_owned());
    }
    // Repeating the question back is not asking for the city.
    let lower = lower.replace(&UNDERSPECIFIED.to_lowercase(), "");
    if lower.trim().is_empty() {
        return (
            Verdict::Fail,
            format!("only repeated the question: {}", quote(&r.content)),
        );
    }
    let asks = lower.contains('?')
        || ["city", "where", "location", "which"]
            .iter()
            .any(|w| lower.contains(w));
    if asks {
        (
            Verdict::Pass,
            format!(
                "asked for the missing city instead of calling: {}",
                quote(&r.content)
            ),
        )
    } else {
        (
            Verdict::Partial,
            format!(
                "no call, but did not ask for the city: {}",
                quote(&r.content)
            ),
        )
    }
}

/// The ticket schema the structured-output probes ask for.
pub fn ticket_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
            "estimate_hours": {"type": "integer"}
        },
        "required": ["title", "priority", "estimate_hours"],
        "additionalProperties": false
    })
}

/// The JSON inside a fenced block, or from the first `{`/`[` to the last `}`/`]`.
fn embedded_json(text: &str) -> Option<Value> {
    if let Some(start) = text.find("```") {
        let after = &text[start + 3..];
        let body_start = after.find('\n').map_or(0, |i| i + 1);
        let body = &after[body_start..];
        if let Some(end) = body.find("```") {
            if let Ok(v) = serde_json::from_str(body[..end].trim()) {
                return Some(v);
            }
        }
    }
    let open = text.find(['{', '['])?;
    let close = text.rfind(['}', ']'])?;
    (close > open)
        .then(|| serde_json::from_str(&text[open..=close]).ok())
        .flatten()
}

/// Structured output: a bare JSON object that matches the ticket schema passes;
/// JSON that needs extracting from prose or a fence, or that breaks the schema,
/// is partial; no JSON at all fails.
pub fn judge_structured(r: &ChatReply) -> (Verdict, String) {
    let schema = match Validator::new(ticket_schema()) {
        Ok(v) => v,
        Err(e) => return (Verdict::NotTested, format!("probe schema unusable: {e}")),
    };
    let content = r.content.trim();
    if content.is_empty() {
        let why = if r.reasoning.is_empty() {
            ""
        } else {
            " (reasoning only)"
        };
        return (Verdict::Fail, format!("empty content{why}"));
    }
    let describe = |v: &Value| -> String {
        let errors = schema.validate(v);
        if errors.is_empty() {
            format!(
                "matches the schema (priority={}, estimate_hours={})",
                v.get("priority").unwrap_or(&Value::Null),
                v.get("estimate_hours").unwrap_or(&Value::Null)
            )
        } else {
            format!("breaks the schema: {}", errors.join("; "))
        }
    };
    match serde_json::from_str::<Value>(content) {
        Ok(v) if schema.validate(&v).is_empty() => {
            (Verdict::Pass, format!("bare JSON object, {}", describe(&v)))
        }
        Ok(v) => (Verdict::Partial, format!("bare JSON, but {}", describe(&v))),
        Err(_) => match embedded_json(content) {
            Some(v) => (
                Verdict::Partial,
                format!("JSON wrapped in prose or a code fence; {}", describe(&v)),
            ),
            None if r.finish_reason.as_deref() == Some("length") => (
                Verdict::Fail,
                format!(
                    "max_tokens ran out before the JSON was complete: {}",
                    quote(content)
                ),
            ),
            None => (
                Verdict::Fail,
                format!("no JSON in the answer: {}", quote(content)),
            ),
        },
    }
}

/// reasoning/default: records whether reasoning is on without asking for it.
pub fn judge_reasoning_default(r: &ChatReply) -> (Verdict, String) {
    if leaks(&r.content) {
        return (
            Verdict::Fail,
            format!("thinking markup leaked into content: {}", quote(&r.content)),
        );
    }
    if !r.reasoning.trim().is_empty() {
        return (
            Verdict::Pass,
            format!(
                "reasoning returned separately by default ({} chars)",
                r.reasoning.chars().count()
            ),
        );
    }
    if r.content.trim().is_empty() {
        return (Verdict::Fail, "empty answer".to_owned());
    }
    (
        Verdict::NotTested,
        "no reasoning trace; thinking is off by default".to_owned(),
    )
}

/// reasoning/enable-thinking: a separate reasoning trace and a clean answer.
pub fn judge_reasoning_enabled(r: &ChatReply, default_tokens: Option<u32>) -> (Verdict, String) {
    let ratio = match (r.completion_tokens, default_tokens) {
        (Some(on), Some(off)) if off > 0 => format!(
            "; {:.1}x the completion tokens of the default",
            f64::from(on) / f64::from(off)
        ),
        _ => String::new(),
    };
    let has_reasoning = !r.reasoning.trim().is_empty();
    let has_answer = !r.content.trim().is_empty();
    if leaks(&r.content) {
        return (
            Verdict::Partial,
            format!(
                "thinking text mixed into content: {}{ratio}",
                quote(&r.content)
            ),
        );
    }
    match (has_reasoning, has_answer) {
        (true, true) => (
            Verdict::Pass,
            format!(
                "reasoning ({} chars) split from the answer ({} chars){ratio}",
                r.reasoning.chars().count(),
                r.content.chars().count()
            ),
        ),
        (true, false) => (
            Verdict::Partial,
            format!("reasoning but no final answer within max_tokens{ratio}"),
        ),
        (false, true) => (
            Verdict::Fail,
            format!("no reasoning trace with enable_thinking{ratio}"),
        ),
        (false, false) => (Verdict::Fail, "empty answer".to_owned()),
    }
}

/// Sends one chat request and times it.
async fn chat(
    endpoint: &Endpoint,
    body: &Value,
    timeout: Duration,
) -> (Result<ChatReply, CallError>, f64) {
    let start = Instant::now();
    let answer = endpoint
        .post_json("v1/chat/completions", body, Some(timeout))
        .await;
    let latency = start.elapsed().as_secs_f64() * 1000.0;
    let reply = answer.and_then(|v| parse_reply(&v).map_err(CallError::Protocol));
    (reply, latency)
}

/// Turns a call's outcome into a probe using `judge` on success.
fn probe(
    name: &str,
    outcome: &(Result<ChatReply, CallError>, f64),
    judge: impl FnOnce(&ChatReply) -> (Verdict, String),
) -> Probe {
    let (verdict, observed) = match &outcome.0 {
        Ok(reply) => judge(reply),
        Err(CallError::Transport(m)) => (Verdict::NotTested, format!("server unreachable: {m}")),
        Err(e) => (Verdict::Fail, format!("request failed: {e}")),
    };
    let reached = !matches!(outcome.0, Err(CallError::Transport(_)));
    Probe {
        name: name.to_owned(),
        verdict,
        latency_ms: if reached { round(outcome.1, 1) } else { None },
        observed,
    }
}

fn domain(name: &str, conditions: Value, probes: Vec<Probe>, notes: Option<String>) -> Capability {
    let verdicts: Vec<Verdict> = probes.iter().map(|p| p.verdict).collect();
    Capability {
        domain: name.to_owned(),
        verdict: Verdict::combine(&verdicts),
        conditions,
        probes,
        notes,
    }
}

/// Runs every probe against `model` and returns the three capability domains.
pub async fn run_probes(endpoint: &Endpoint, model: &str, timeout: Duration) -> Vec<Capability> {
    vec![
        tool_calling(endpoint, model, timeout).await,
        structured_output(endpoint, model, timeout).await,
        reasoning(endpoint, model, timeout).await,
    ]
}

async fn tool_calling(endpoint: &Endpoint, model: &str, timeout: Duration) -> Capability {
    let tools = json!([weather_tool()]);
    let ask = |messages: Value| {
        json!({
            "model": model, "messages": messages, "tools": tools, "tool_choice": "auto",
            "temperature": 0, "max_tokens": 256
        })
    };
    let user = |text: &str| json!([{"role": "user", "content": text}]);

    let simple = chat(
        endpoint,
        &ask(user(
            "What's the weather in Paris right now? I want the temperature in celsius.",
        )),
        timeout,
    )
    .await;
    let synthesis_messages = json!([
        {"role": "user", "content": "What's the weather in Paris right now?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}
        }]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "{\"city\": \"Paris\", \"temperature\": 18, \"unit\": \"celsius\", \"condition\": \"sunny\"}"}
    ]);
    let synthesis = chat(endpoint, &ask(synthesis_messages), timeout).await;
    let restraint = chat(
        endpoint,
        &ask(user("What is 2 + 2? Reply with just the number.")),
        timeout,
    )
    .await;
    let parallel = chat(
        endpoint,
        &ask(user("What's the weather right now in Paris and in Tokyo?")),
        timeout,
    )
    .await;
    let vague = chat(endpoint, &ask(user(UNDERSPECIFIED)), timeout).await;

    domain(
        "tool_calling",
        json!({"tool_choice": "auto", "temperature": 0, "max_tokens": 256}),
        vec![
            probe("simple-call", &simple, judge_simple_call),
            probe("result-synthesis", &synthesis, judge_result_synthesis),
            probe("no-tool-restraint", &restraint, judge_no_tool_restraint),
            probe("parallel-calls", &parallel, judge_parallel_calls),
            probe("underspecified", &vague, judge_underspecified),
        ],
        None,
    )
}

async fn structured_output(endpoint: &Endpoint, model: &str, timeout: Duration) -> Capability {
    let task = "File a ticket: the login page returns a 500 error for every user. It must be fixed ASAP and will take about 3 hours.";
    let json_schema = json!({"type": "json_schema", "json_schema": {"name": "ticket", "strict": true, "schema": ticket_schema()}});
    let ask = |format: &Value, thinking: bool, text: &str, max_tokens: u32| {
        json!({
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "response_format": format,
            "chat_template_kwargs": {"enable_thinking": thinking},
            "temperature": 0,
            "max_tokens": max_tokens
        })
    };
    let off = chat(endpoint, &ask(&json_schema, false, task, 256), timeout).await;
    let object_task = format!(
        "{task} Answer with a JSON object with the keys title (string), priority (low, medium or high) and estimate_hours (integer)."
    );
    let object = chat(
        endpoint,
        &ask(&json!({"type": "json_object"}), false, &object_task, 256),
        timeout,
    )
    .await;
    let on = chat(endpoint, &ask(&json_schema, true, task, 2048), timeout).await;
    domain(
        "structured_output",
        json!({"temperature": 0, "schema": "ticket {title, priority enum, estimate_hours integer}"}),
        vec![
            probe("json_schema-thinking-off", &off, judge_structured),
            probe("json_object-thinking-off", &object, judge_structured),
            probe("json_schema-thinking-on", &on, judge_structured),
        ],
        Some("Pass needs a bare JSON object that validates; fenced or prose-wrapped JSON is partial.".to_owned()),
    )
}

async fn reasoning(endpoint: &Endpoint, model: &str, timeout: Duration) -> Capability {
    let question = "Which is larger, 9.11 or 9.9? Answer in one short sentence.";
    let base = json!({"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 512});
    let mut thinking = base.clone();
    thinking["chat_template_kwargs"] = json!({"enable_thinking": true});
    thinking["max_tokens"] = json!(2048);
    let default = chat(endpoint, &base, timeout).await;
    let enabled = chat(endpoint, &thinking, timeout).await;
    let default_tokens = default.0.as_ref().ok().and_then(|r| r.completion_tokens);
    domain(
        "reasoning",
        json!({"enable_thinking": true, "temperature": 0}),
        vec![
            probe("default", &default, judge_reasoning_default),
            probe("enable-thinking", &enabled, |r| {
                judge_reasoning_enabled(r, default_tokens)
            }),
        ],
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(content: &str, calls: &[(&str, &str)]) -> ChatReply {
        ChatReply {
            content: content.to_owned(),
            tool_calls: calls
                .iter()
                .map(|(name, args)| ToolCall {
                    name: (*name).to_owned(),
                    arguments: serde_json::from_str(args).map_err(|_| (*args).to_owned()),
                })
                .collect(),
            ..ChatReply::default()
        }
    }

    #[test]
    fn parses_chat_answers() {
        let v = json!({"choices": [{"message": {"content": null, "reasoning_content": "hm",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            "finish_reason": "tool_calls"}],
            "usage": {"completion_tokens": 12}});
        let r = parse_reply(&v);
        assert_eq!(
            r,
            Ok(ChatReply {
                content: String::new(),
                reasoning: "hm".to_owned(),
                tool_calls: vec![ToolCall {
                    name: "get_weather".to_owned(),
                    arguments: Ok(json!({"city": "Paris"}))
                }],
                completion_tokens: Some(12),
                finish_reason: Some("tool_calls".to_owned()),
            })
        );
        assert!(parse_reply(&json!({"object": "error"})).is_err());
    }

    #[test]
    fn tool_call_rules() {
        let good = reply(
            "",
            &[("get_weather", r#"{"city":"Paris","unit":"celsius"}"#)],
        );
        assert_eq!(judge_simple_call(&good).0, Verdict::Pass);
        assert_eq!(
            judge_simple_call(&reply("It is sunny.", &[])).0,
            Verdict::Fail
        );
        assert_eq!(
            judge_simple_call(&reply("<|tool_call>call:get_weather{}", &[])).0,
            Verdict::Partial
        );
        assert_eq!(
            judge_simple_call(&reply("", &[("get_weather", "{city")])).0,
            Verdict::Partial
        );
        assert_eq!(
            judge_simple_call(&reply("", &[("get_time", "{}")])).0,
            Verdict::Fail
        );

        assert_eq!(
            judge_result_synthesis(&reply("It is 18°C and sunny in Paris.", &[])).0,
            Verdict::Pass
        );
        assert_eq!(
            judge_result_synthesis(&reply("It is nice.", &[])).0,
            Verdict::Partial
        );
        assert_eq!(judge_result_synthesis(&good).0, Verdict::Fail);

        assert_eq!(judge_no_tool_restraint(&reply("4", &[])).0, Verdict::Pass);
        assert_eq!(judge_no_tool_restraint(&good).0, Verdict::Fail);

        let both = reply(
            "",
            &[
                ("get_weather", r#"{"city":"Paris"}"#),
                ("get_weather", r#"{"city":"Tokyo"}"#),
            ],
        );
        assert_eq!(judge_parallel_calls(&both).0, Verdict::Pass);
        assert_eq!(judge_parallel_calls(&good).0, Verdict::Partial);
        assert_eq!(judge_parallel_calls(&reply("no", &[])).0, Verdict::Fail);

        assert_eq!(
            judge_underspecified(&reply("Which city do you mean?", &[])).0,
            Verdict::Pass
        );
        assert_eq!(judge_underspecified(&good).0, Verdict::Fail);
        assert_eq!(
            judge_underspecified(&reply("", &[("get_weather", "{}")])).0,
            Verdict::Partial
        );
        assert_eq!(
            judge_underspecified(&reply("It is sunny.", &[])).0,
            Verdict::Partial
        );
        let echo = format!("{UNDERSPECIFIED} {UNDERSPECIFIED}");
        assert_eq!(judge_underspecified(&reply(&echo, &[])).0, Verdict::Fail);
    }

    #[test]
    fn structured_output_rules() {
        let bare = reply(
            r#"{"title":"Login 500","priority":"high","estimate_hours":3}"#,
            &[],
        );
        assert_eq!(judge_structured(&bare).0, Verdict::Pass);
        let fenced = reply(
            "```json\n{\"title\":\"Login 500\",\"priority\":\"high\",\"estimate_hours\":3}\n```",
            &[],
        );
        assert_eq!(judge_structured(&fenced).0, Verdict::Partial);
        let wrong = reply(
            r#"{"title":"x","priority":"urgent","estimate_hours":3}"#,
            &[],
        );
        let (v, observed) = judge_structured(&wrong);
        assert_eq!(v, Verdict::Partial);
        assert!(observed.contains("priority"), "{observed}");
        assert_eq!(
            judge_structured(&reply("Sure! The ticket is filed.", &[])).0,
            Verdict::Fail
        );
        assert_eq!(judge_structured(&reply("", &[])).0, Verdict::Fail);
        let mut cut = reply(r#"{"title": "Login page returns"#, &[]);
        cut.finish_reason = Some("length".to_owned());
        let (v, observed) = judge_structured(&cut);
        assert_eq!(v, Verdict::Fail);
        assert!(observed.contains("max_tokens ran out"), "{observed}");
    }

    #[test]
    fn reasoning_rules() {
        let plain = reply("9.9 is larger.", &[]);
        assert_eq!(judge_reasoning_default(&plain).0, Verdict::NotTested);
        let mut thought = plain.clone();
        thought.reasoning = "compare 0.11 and 0.9".to_owned();
        thought.completion_tokens = Some(30);
        assert_eq!(judge_reasoning_default(&thought).0, Verdict::Pass);
        let (v, observed) = judge_reasoning_enabled(&thought, Some(10));
        assert_eq!(v, Verdict::Pass);
        assert!(observed.contains("3.0x"), "{observed}");
        assert_eq!(judge_reasoning_enabled(&plain, None).0, Verdict::Fail);
        assert_eq!(
            judge_reasoning_enabled(&reply("<think>x</think>9.9", &[]), None).0,
            Verdict::Partial
        );
    }

    #[test]
    fn failures_become_verdicts() {
        let down = (
            Err(CallError::Transport("connection refused".to_owned())),
            1.0,
        );
        let p = probe("x", &down, judge_simple_call);
        assert_eq!((p.verdict, p.latency_ms), (Verdict::NotTested, None));
        let rejected = (
            Err(CallError::Status {
                status: 400,
                message: "no chat template".to_owned(),
            }),
            3.0,
        );
        let p = probe("x", &rejected, judge_simple_call);
        assert_eq!(p.verdict, Verdict::Fail);
        assert!(
            p.observed.contains("HTTP 400: no chat template"),
            "{}",
            p.observed
        );
    }
}
