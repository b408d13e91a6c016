//! Conformance of the Gemma 4 output protocol: generated text → parsed message.
//!
//! Each case is a model turn as text (markers spelled out) and the message it
//! must give. The text is tokenized with a Gemma 4 vocabulary (markers become
//! their special tokens), then fed to [`OutputProcessor`] three ways: all at
//! once, one token at a time with the engine releasing each token's text, and
//! for every byte boundary of the text, with the engine holding back
//! everything past that boundary until the end (as it does while a stop string
//! may be matching). Every way must give the expected message.

mod common;

use std::sync::Arc;

use gemma4_text::{
    AssistantMessage, IncrementalDecoder, OutputEvent, OutputProcessor, Tokenizer, ToolCall,
    TurnEnd,
};
use serde_json::{json, Value};

fn tokenizer() -> Arc<Tokenizer> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/e-style");
    Arc::new(Tokenizer::from_dir(&dir).expect("the e-style fixture tokenizer loads"))
}

/// A turn's ids and the text the engine releases with each id (what its
/// incremental decoder gives), plus what it releases at the end.
fn engine_view(tok: &Arc<Tokenizer>, text: &str) -> (Vec<u32>, Vec<String>, String) {
    let ids = tok.encode(text, false).expect("encodes");
    let mut decoder = IncrementalDecoder::new(tok.clone());
    let released = ids
        .iter()
        .map(|&id| decoder.push(id).expect("decodes").unwrap_or_default())
        .collect();
    let rest = decoder.finish().expect("decodes").unwrap_or_default();
    (ids, released, rest)
}

fn run(
    tok: &Arc<Tokenizer>,
    prompt: &[u32],
    ids: &[u32],
    released: &[String],
    rest: &str,
) -> (AssistantMessage, Vec<OutputEvent>) {
    let mut p = OutputProcessor::new(tok.clone(), prompt, "call_".into());
    let mut events = Vec::new();
    for (&id, text) in ids.iter().zip(released) {
        events.extend(p.push(id, text).expect("push"));
    }
    events.extend(p.finish(rest).expect("finish"));
    (AssistantMessage::from_events(&events), events)
}

/// Checks one case every way; returns the message.
fn check(text: &str, prompt: &[u32], expected: &AssistantMessage) {
    let tok = tokenizer();
    let (ids, released, rest) = engine_view(&tok, text);
    let full: String = released
        .iter()
        .map(String::as_str)
        .chain([rest.as_str()])
        .collect();
    assert_eq!(full, text, "the fixture vocabulary round-trips the case");

    // All at once: nothing released until the end.
    let none = vec![String::new(); ids.len()];
    let (whole, _) = run(&tok, prompt, &ids, &none, &full);
    assert_eq!(&whole, expected, "whole parse of {text:?}");

    // Token by token.
    let (streamed, events) = run(&tok, prompt, &ids, &released, &rest);
    assert_eq!(&streamed, expected, "token stream of {text:?}");
    check_event_order(&events);

    // Held back at every byte boundary.
    let mut bounds = vec![0];
    let mut pos = 0;
    for r in &released {
        pos += r.len();
        bounds.push(pos);
    }
    for cut in (0..=full.len()).filter(|&c| full.is_char_boundary(c)) {
        let mut sent = 0;
        let held: Vec<String> = bounds[1..]
            .iter()
            .map(|&b| {
                let upto = b.min(cut).max(sent);
                let piece = full[sent..upto].to_owned();
                sent = upto;
                piece
            })
            .collect();
        let (split, _) = run(&tok, prompt, &ids, &held, &full[sent..]);
        assert_eq!(&split, expected, "{text:?} held back at byte {cut}");
    }
}

/// A stream names each call once, before its arguments, and ends it once.
fn check_event_order(events: &[OutputEvent]) {
    let mut started = Vec::new();
    let mut ended = Vec::new();
    for e in events {
        match e {
            OutputEvent::ToolCallStart { index, .. } => {
                assert!(!started.contains(index), "call {index} started twice");
                started.push(*index);
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                assert!(started.contains(index) && !ended.contains(index));
                assert!(!delta.is_empty());
            }
            OutputEvent::ToolCallEnd { index } => {
                assert!(started.contains(index) && !ended.contains(index));
                ended.push(*index);
            }
            OutputEvent::Content(t) | OutputEvent::Reasoning(t) => assert!(!t.is_empty()),
        }
    }
}

fn message(content: &str, reasoning: &str, calls: &[(&str, Value)]) -> AssistantMessage {
    AssistantMessage {
        content: content.into(),
        reasoning: reasoning.into(),
        tool_calls: calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ToolCall {
                id: format!("call_{i}"),
                name: (*name).into(),
                arguments: python_json(args),
                complete: true,
            })
            .collect(),
    }
}

/// `json.dumps(value, ensure_ascii=False)`: `", "` and `": "` separators.
fn python_json(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_json).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

const Q: &str = "<|\"|>";

#[test]
fn plain_answer() {
    check(
        "The capital is Paris.",
        &[],
        &message("The capital is Paris.", "", &[]),
    );
}

#[test]
fn thinking_then_answer() {
    check(
        "<|channel>thought\nThe user wants a city.<channel|>Paris.",
        &[],
        &message("Paris.", "The user wants a city.", &[]),
    );
}

#[test]
fn thinking_without_label_and_empty_thought() {
    check(
        "<|channel>no label here<channel|>ok",
        &[],
        &message("ok", "no label here", &[]),
    );
    check(
        "<|channel>thought\n<channel|>ok",
        &[],
        &message("ok", "", &[]),
    );
}

#[test]
fn prompt_ending_inside_a_channel_starts_as_reasoning() {
    let tok = tokenizer();
    let prompt = tok
        .encode("<|turn>model\n<|channel>thought\n", false)
        .expect("encodes");
    check(
        "still thinking<channel|>answer",
        &prompt,
        &message("answer", "still thinking", &[]),
    );
    // A closed channel in the prompt (thinking off on large models) does not.
    let closed = tok
        .encode("<|turn>model\n<|channel>thought\n<channel|>", false)
        .expect("encodes");
    check("answer", &closed, &message("answer", "", &[]));
}

#[test]
fn one_tool_call() {
    check(
        &format!("<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"),
        &[],
        &message("", "", &[("get_weather", json!({"city": "Paris"}))]),
    );
}

#[test]
fn several_tool_calls_with_text_before() {
    check(
        &format!(
            "Let me check.<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>\
             <|tool_call>call:get_time{{zone:{Q}CET{Q}}}<tool_call|>"
        ),
        &[],
        &message(
            "Let me check.",
            "",
            &[
                ("get_weather", json!({"city": "Paris", "days": 3})),
                ("get_time", json!({"zone": "CET"})),
            ],
        ),
    );
}

#[test]
fn nested_array_unicode_and_empty_arguments() {
    check(
        &format!(
            "<|tool_call>call:plan{{steps:[{{name:{Q}früh ☃ 東京{Q},n:1.5}},{{}}],\
             empty:{{}},none:[],flag:true,nothing:null}}<tool_call|>"
        ),
        &[],
        &message(
            "",
            "",
            &[(
                "plan",
                json!({"steps": [{"name": "früh ☃ 東京", "n": 1.5}, {}], "empty": {},
                       "none": [], "flag": true, "nothing": null}),
            )],
        ),
    );
}

#[test]
fn strings_with_json_punctuation_and_quotes() {
    let tricky = r#"a {b}, c: "d" [e] \ f"#;
    check(
        &format!("<|tool_call>call:echo{{text:{Q}{tricky}{Q},k:{Q}{Q}}}<tool_call|>"),
        &[],
        &message("", "", &[("echo", json!({"text": tricky, "k": ""}))]),
    );
}

#[test]
fn call_after_thinking() {
    check(
        &format!(
            "<|channel>thought\nI need the weather.<channel|>\
             <|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>"
        ),
        &[],
        &message(
            "",
            "I need the weather.",
            &[("get_weather", json!({"city": "Oslo"}))],
        ),
    );
}

#[test]
fn call_without_arguments() {
    check(
        "<|tool_call>call:list_files{}<tool_call|>",
        &[],
        &message("", "", &[("list_files", json!({}))]),
    );
    check(
        "<|tool_call>call:ping<tool_call|>",
        &[],
        &message("", "", &[("ping", json!({}))]),
    );
}

#[test]
fn truncated_mid_call_keeps_the_partial_call() {
    let text = format!("<|tool_call>call:search{{query:{Q}rust par");
    let expected = AssistantMessage {
        tool_calls: vec![ToolCall {
            id: "call_0".into(),
            name: "search".into(),
            arguments: r#"{"query": "rust par"#.into(),
            complete: false,
        }],
        ..AssistantMessage::default()
    };
    check(&text, &[], &expected);
    // Cut before the name was complete: no call, and no markup in content.
    check("Sure.<|tool_call>call:sea", &[], &message("Sure.", "", &[]));
}

#[test]
fn stray_markup_never_reaches_content() {
    check(
        &format!("a{Q}b<tool_call|>c<channel|>d<|tool>e<tool|>"),
        &[],
        &message("abcde", "", &[]),
    );
}

#[test]
fn marker_lookalike_text_is_text() {
    // Characters that spell a marker without being its token stay content.
    let tok = tokenizer();
    let ids: Vec<u32> = "<|tool_call>"
        .chars()
        .flat_map(|c| tok.encode(&c.to_string(), false).expect("encodes"))
        .collect();
    let mut p = OutputProcessor::new(tok.clone(), &[], "call_".into());
    let mut events = Vec::new();
    let mut decoder = IncrementalDecoder::new(tok.clone());
    for &id in &ids {
        let text = decoder.push(id).expect("decodes").unwrap_or_default();
        events.extend(p.push(id, &text).expect("push"));
    }
    // What the decoder still holds comes out at the end, as the engine flushes it.
    let rest = decoder.finish().expect("decodes").unwrap_or_default();
    events.extend(p.finish(&rest).expect("finish"));
    assert_eq!(
        AssistantMessage::from_events(&events),
        message("<|tool_call>", "", &[])
    );
}

#[test]
fn finish_reason_is_tool_calls_after_a_complete_call() {
    let tok = tokenizer();
    let reason = |text: &str, end: TurnEnd| {
        let (ids, released, rest) = engine_view(&tok, text);
        let mut p = OutputProcessor::new(tok.clone(), &[], "c".into());
        for (&id, t) in ids.iter().zip(&released) {
            p.push(id, t).expect("push");
        }
        p.finish(&rest).expect("finish");
        p.finish_reason(end)
    };
    let call = "<|tool_call>call:f{}<tool_call|>";
    assert_eq!(reason(call, TurnEnd::Stop), "tool_calls");
    assert_eq!(reason(call, TurnEnd::Length), "length");
    assert_eq!(reason("<|tool_call>call:f{a:1", TurnEnd::Stop), "stop");
    assert_eq!(reason("x", TurnEnd::Stop), "stop");
}

#[test]
fn stop_string_cut_is_respected() {
    // The engine matched a stop string at "STOP" and released only the text before it.
    let tok = tokenizer();
    let (ids, _, _) = engine_view(&tok, "<|channel>thought\nhmm<channel|>yes STOP no");
    let none = vec![String::new(); ids.len()];
    let (m, _) = run(
        &tok,
        &[],
        &ids,
        &none,
        "<|channel>thought\nhmm<channel|>yes ",
    );
    assert_eq!(m, message("yes ", "hmm", &[]));
}

#[test]
fn reasoning_tokens_are_counted() {
    let tok = tokenizer();
    let (ids, released, _) = engine_view(&tok, "<|channel>thought\nabc<channel|>d");
    let mut p = OutputProcessor::new(tok.clone(), &[], "c".into());
    let mut thinking = Vec::new();
    for (&id, text) in ids.iter().zip(&released) {
        p.push(id, text).expect("push");
        thinking.push(p.is_thinking());
    }
    // Every id after `<|channel>` and before `<channel|>` is a reasoning token.
    let tail = tok.encode("d", false).expect("encodes").len();
    let inside = ids.len() - 2 - tail;
    assert_eq!(p.reasoning_tokens(), inside);
    assert!(thinking[0] && !thinking[ids.len() - 1]);
}
