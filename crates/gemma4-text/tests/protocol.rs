//! Conformance of the Gemma 4 output protocol: generated text → parsed message.
//!
//! Each case is a model turn as text (markers spelled out) and the message it
//! must give. The text is tokenized with a Gemma 4 vocabulary (markers become
//! their special tokens), detokenized by a request's [`TextOutput`] into
//! released pieces, then fed to the [`TurnParser`] three ways: all at once,
//! as released id by id, and for every character boundary of the text, with
//! everything past that boundary held back until the end (as a stop string
//! that may be matching holds it). Every way must give the expected message.

mod common;

use std::sync::Arc;

use gemma4_text::{
    AssistantMessage, ChannelState, OutputEvent, Piece, ProtocolTokens, Reading, RequestOutput,
    TextOutput, Tokenizer, ToolCall, TurnParser,
};
use serde_json::{json, Value};

fn tokenizer() -> Arc<Tokenizer> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/e-style");
    Arc::new(Tokenizer::from_dir(&dir).expect("the e-style fixture tokenizer loads"))
}

/// A turn's ids and the pieces its output releases with each id, plus those
/// released at the end.
fn engine_view(tok: &Arc<Tokenizer>, text: &str) -> (Vec<u32>, Vec<Vec<Piece>>, Vec<Piece>) {
    let ids = tok.encode(text, false).expect("encodes");
    let mut output = TextOutput::new(tok.clone(), ProtocolTokens::new(tok), &[]);
    let released = ids
        .iter()
        .map(|&id| output.push(id).expect("decodes").pieces)
        .collect();
    let rest = output.finish().expect("decodes").pieces;
    (ids, released, rest)
}

fn run(
    tok: &Arc<Tokenizer>,
    prompt: &[u32],
    released: &[Vec<Piece>],
    rest: &[Piece],
) -> (AssistantMessage, Vec<OutputEvent>) {
    let mut p = TurnParser::new(&ProtocolTokens::new(tok), prompt, "call_".into());
    let mut events = Vec::new();
    for piece in released.iter().flatten().chain(rest) {
        p.push(piece, &mut events);
    }
    p.finish(&mut events);
    (AssistantMessage::from_events(&events), events)
}

fn spelling(piece: &Piece) -> &str {
    match piece {
        Piece::Text(t) => t,
        Piece::Marker(m) => m.as_str(),
    }
}

/// `pieces` with everything from byte `cut` of their text on held back:
/// (released, held). A cut inside a marker holds the whole marker.
fn hold_from(pieces: &[Piece], cut: usize) -> (Vec<Piece>, Vec<Piece>) {
    let (mut released, mut held) = (Vec::new(), Vec::new());
    let mut pos = 0;
    for piece in pieces {
        let len = spelling(piece).len();
        match piece {
            Piece::Text(t) if pos < cut && cut < pos + len => {
                released.push(Piece::Text(t[..cut - pos].to_owned()));
                held.push(Piece::Text(t[cut - pos..].to_owned()));
            }
            _ if pos + len <= cut => released.push(piece.clone()),
            _ => held.push(piece.clone()),
        }
        pos += len;
    }
    (released, held)
}

/// Checks one case every way; returns the message.
fn check(text: &str, prompt: &[u32], expected: &AssistantMessage) {
    let tok = tokenizer();
    let (_, released, rest) = engine_view(&tok, text);
    let all: Vec<Piece> = released.iter().flatten().chain(&rest).cloned().collect();
    let full: String = all.iter().map(spelling).collect();
    assert_eq!(full, text, "the fixture vocabulary round-trips the case");

    // All at once: nothing released until the end.
    let (whole, _) = run(&tok, prompt, &[], &all);
    assert_eq!(&whole, expected, "whole parse of {text:?}");

    // Id by id.
    let (streamed, events) = run(&tok, prompt, &released, &rest);
    assert_eq!(&streamed, expected, "token stream of {text:?}");
    check_event_order(&events);

    // Held back at every character boundary.
    for cut in (0..=full.len()).filter(|&c| full.is_char_boundary(c)) {
        let (first, held) = hold_from(&all, cut);
        let pieces: Vec<Vec<Piece>> = first.into_iter().map(|p| vec![p]).collect();
        let (split, _) = run(&tok, prompt, &pieces, &held);
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

/// A chat turn's events and output, read by a request's [`RequestOutput`].
fn chat_output(tok: &Arc<Tokenizer>, stops: &[String]) -> RequestOutput {
    let reading = Reading::Chat {
        call_id_prefix: "call_".into(),
    };
    RequestOutput::new(tok.clone(), ProtocolTokens::new(tok), &[], stops, &reading)
}

fn read_all(output: &mut RequestOutput, ids: &[u32]) -> Vec<OutputEvent> {
    let mut events = Vec::new();
    for &id in ids {
        let step = output.push(id).expect("push");
        events.extend(step.events);
        if step.stopped.is_some() {
            break;
        }
    }
    events.extend(output.finish().expect("finish").events);
    events
}

#[test]
fn marker_lookalike_text_is_text() {
    // Characters that spell a marker without being its token stay content.
    let tok = tokenizer();
    let ids: Vec<u32> = "<|tool_call>"
        .chars()
        .flat_map(|c| tok.encode(&c.to_string(), false).expect("encodes"))
        .collect();
    let events = read_all(&mut chat_output(&tok, &[]), &ids);
    assert_eq!(
        AssistantMessage::from_events(&events),
        message("<|tool_call>", "", &[])
    );
}

#[test]
fn completed_calls_are_counted() {
    let tok = tokenizer();
    let calls = |text: &str| {
        let ids = tok.encode(text, false).expect("encodes");
        let mut output = chat_output(&tok, &[]);
        read_all(&mut output, &ids);
        output.completed_calls()
    };
    assert_eq!(calls("<|tool_call>call:f{}<tool_call|>"), 1);
    assert_eq!(
        calls("<|tool_call>call:f{}<tool_call|><|tool_call>call:g{}<tool_call|>"),
        2
    );
    assert_eq!(calls("<|tool_call>call:f{a:1"), 0);
    assert_eq!(calls("x"), 0);
}

#[test]
fn stop_string_cut_is_respected() {
    // A stop string matched at "STOP": the turn is cut before it.
    let tok = tokenizer();
    let ids = tok
        .encode("<|channel>thought\nhmm<channel|>yes STOP no", false)
        .expect("encodes");
    let mut output = chat_output(&tok, &["STOP".into()]);
    let events = read_all(&mut output, &ids);
    assert_eq!(
        AssistantMessage::from_events(&events),
        message("yes ", "hmm", &[])
    );
}

#[test]
fn a_stop_string_never_releases_half_a_marker() {
    // A stop string that starts inside a marker's spelling cuts the text
    // before the marker: its token is released whole, or not at all.
    let tok = tokenizer();
    let ids = tok
        .encode("ab<|tool_call>call:f{}<tool_call|>", false)
        .expect("encodes");
    let mut output = TextOutput::new(
        tok.clone(),
        ProtocolTokens::new(&tok),
        &["tool_call>call".into()],
    );
    let first = output.push(ids[0]).expect("push");
    let mut texts = vec![first.text];
    let mut stopped = None;
    for &id in &ids[1..] {
        let step = output.push(id).expect("push");
        texts.push(step.text);
        stopped = stopped.or(step.stopped);
    }
    assert_eq!(
        stopped.as_deref(),
        Some("tool_call>call"),
        "the stop string spans the marker's spelling"
    );
    assert_eq!(texts.concat(), "ab");
}

#[test]
fn reasoning_tokens_are_counted() {
    let tok = tokenizer();
    let ids = tok
        .encode("<|channel>thought\nabc<channel|>d", false)
        .expect("encodes");
    let mut output = chat_output(&tok, &[]);
    let mut channel = ChannelState::after_prompt(ProtocolTokens::new(&tok), &[]);
    let mut thinking = Vec::new();
    for &id in &ids {
        output.push(id).expect("push");
        channel.accept(id);
        thinking.push(channel.in_thought());
    }
    // Every id after `<|channel>` and before `<channel|>` is a reasoning token.
    let tail = tok.encode("d", false).expect("encodes").len();
    let inside = ids.len() - 2 - tail;
    assert_eq!(output.reasoning_tokens(), inside);
    assert!(thinking[0] && !thinking[ids.len() - 1]);
}

/// The assistant turns transformers rendered in a template fixture, each
/// with the text before it and the message it came from: each model turn
/// up to its end, split at the tool responses written into it; the open
/// turn a generation prompt leaves is not a message.
fn rendered_turns(case: &Value) -> Vec<(String, String, Value)> {
    let text = case["text"].as_str().expect("text");
    let messages: Vec<&Value> = case["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .collect();
    let open = "<|turn>model\n";
    let (mut turns, mut used) = (Vec::new(), 0);
    let mut answer_after_responses: Option<Value> = None;
    for (start, _) in text.match_indices(open) {
        let body_start = start + open.len();
        let ends_turn = text[body_start..].contains("<turn|>");
        let body_end = text[body_start..]
            .find("<turn|>")
            .map_or(text.len(), |i| body_start + i);
        for (piece_start, piece) in split_at_tool_responses(text, body_start, body_end) {
            let generation_prompt = !ends_turn
                && !piece.contains("<|tool_call>")
                && piece
                    .replace("<|channel>thought\n<channel|>", "")
                    .trim()
                    .is_empty();
            if piece.is_empty() || generation_prompt {
                continue;
            }
            // A message with native `tool_responses` is two generations: its calls,
            // then, after the responses, its content.
            if let Some(content) = answer_after_responses.take() {
                turns.push((text[..piece_start].to_owned(), piece.to_owned(), content));
                continue;
            }
            let Some(&message) = messages.get(used) else {
                panic!(
                    "{}: a rendered turn without its message: {piece:?}",
                    case["name"]
                );
            };
            used += 1;
            let mut message = message.clone();
            if message.get("tool_responses").is_some() {
                answer_after_responses = Some(json!({"content": message["content"].take()}));
            }
            turns.push((text[..piece_start].to_owned(), piece.to_owned(), message));
        }
    }
    assert_eq!(
        used,
        messages.len(),
        "{}: one turn per assistant message",
        case["name"]
    );
    turns
}

/// `text[start..end]` in the pieces between its tool responses, each with
/// where it starts.
fn split_at_tool_responses(text: &str, start: usize, end: usize) -> Vec<(usize, &str)> {
    let (open, close) = ("<|tool_response>", "<tool_response|>");
    let mut pieces = Vec::new();
    let mut at = start;
    while let Some(i) = text[at..end].find(open) {
        pieces.push((at, &text[at..at + i]));
        let after = at + i + open.len();
        at = text[after..end]
            .find(close)
            .map_or(end, |j| after + j + close.len());
    }
    pieces.push((at, &text[at..end]));
    pieces
}

/// A message's calls as (name, arguments as a JSON value).
fn expected_calls(message: &Value) -> Vec<(String, Value)> {
    let calls = message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).expect("arguments as JSON text"),
                other => other.clone(),
            };
            (f["name"].as_str().expect("name").to_owned(), args)
        })
        .collect()
}

#[test]
fn every_transformers_rendered_turn_parses_back_to_its_message() {
    let tok = tokenizer();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/text/templates");
    let mut checked = 0;
    for file in ["gemma4-31b-it.json", "gemma4-31b-it-interleaved.json"] {
        let fixture: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).expect("fixture"))
                .expect("JSON");
        for case in fixture["cases"].as_array().expect("cases") {
            // The template writes arguments sent as JSON text inside braces of its own
            // (`{{"city": "Lima"}}`), a form no model turn takes; the server renders such
            // arguments as objects.
            // A case whose rendering failed (`error`) has no turns.
            if case["name"] == "arguments-as-json-string" || case.get("text").is_none() {
                continue;
            }
            for (before, turn, message) in rendered_turns(case) {
                let name = format!("{file} {}: {turn:?}", case["name"]);
                let prompt = tok.encode(&before, false).expect("encodes");
                let (_, released, rest) = engine_view(&tok, &turn);
                for (way, parsed) in [
                    (
                        "whole",
                        run(
                            &tok,
                            &prompt,
                            &[],
                            &[released.concat(), rest.clone()].concat(),
                        )
                        .0,
                    ),
                    ("streamed", run(&tok, &prompt, &released, &rest).0),
                ] {
                    // A thought written into the content is dropped from history, as the template drops it.
                    let content = message["content"].as_str().unwrap_or_default();
                    let content = content.rsplit("<channel|>").next().unwrap_or_default();
                    assert_eq!(
                        parsed.content.trim(),
                        content.trim(),
                        "{way} content of {name}"
                    );
                    let reasoning = match turn.contains("<|channel>") {
                        true => message["reasoning_content"].as_str().unwrap_or_default(),
                        false => "",
                    };
                    assert_eq!(
                        parsed.reasoning.trim(),
                        reasoning.trim(),
                        "{way} reasoning of {name}"
                    );
                    let calls: Vec<(String, Value)> = parsed
                        .tool_calls
                        .iter()
                        .map(|c| {
                            assert!(c.complete, "{way}: an incomplete call in {name}");
                            let args = serde_json::from_str(&c.arguments)
                                .unwrap_or_else(|e| panic!("{way}: arguments of {name}: {e}"));
                            (c.name.clone(), args)
                        })
                        .collect();
                    assert_eq!(calls, expected_calls(&message), "{way} calls of {name}");
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "only {checked} rendered turns found");
}
