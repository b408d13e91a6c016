//! Real Gemma 4 chat templates rendered by us and by transformers (Python Jinja2,
//! fixtures from `tools/make_template_fixtures.py`) must agree byte for byte, and the
//! rendered text must tokenize to the reference ids with every control and markup
//! token as a single id.

mod common;

use common::{array, first_difference, fixture_dir, gemma4_tokenizer, ids, read_json, read_text};
use common::{string, Fallible, TestResult};
use gemma4_text::{ChatTemplate, TextError};
use serde_json::{Map, Value};

/// Tokens that must never be split when they occur in rendered text.
const SINGLE_ID_TOKENS: [&str; 12] = [
    "<|turn>",
    "<turn|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|\"|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|think|>",
];

/// Renders one fixture case; `Ok(Err(..))` is a template error.
pub fn render_case(template: &ChatTemplate, case: &Value) -> Fallible<Result<String, TextError>> {
    let messages = case.get("messages").ok_or("case without messages")?;
    let tools = case.get("tools").filter(|t| !t.is_null());
    let add_generation_prompt = case
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .ok_or("case without add_generation_prompt")?;
    let kwargs: Map<String, Value> = case
        .get("kwargs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    Ok(template.render(messages, tools, add_generation_prompt, &kwargs))
}

fn load_template(fixture: &Value) -> Fallible<ChatTemplate> {
    let file = string(fixture, "template_file")?;
    let source = read_text(&fixture_dir().join("templates").join(file))?;
    Ok(ChatTemplate::new(source)?.with_special_tokens(
        Some(string(fixture, "bos_token")?.to_owned()),
        Some(string(fixture, "eos_token")?.to_owned()),
    ))
}

/// Renders every case of a fixture file and compares with the reference text or
/// error; with `check_ids`, also tokenizes with the real Gemma 4 vocabulary.
fn check_fixture(name: &str, check_ids: bool) -> TestResult {
    let fixture = read_json(&fixture_dir().join("templates").join(format!("{name}.json")))?;
    let template = load_template(&fixture)?;
    let mut rendered = 0;
    for case in array(&fixture, "cases")? {
        let case_name = string(case, "name")?;
        let result = render_case(&template, case)?;
        if let Some(error) = case.get("error").and_then(Value::as_str) {
            let Err(err) = result else {
                return Err(format!("{name}/{case_name}: expected an error like {error:?}").into());
            };
            if let Some(message) = error.strip_prefix("TemplateError: ") {
                assert!(
                    err.to_string().contains(message),
                    "{name}/{case_name}: {err} does not mention {message:?}"
                );
            }
            continue;
        }
        let expected = string(case, "text")?;
        let text = result.map_err(|e| format!("{name}/{case_name}: {e}"))?;
        assert_eq!(text, expected, "{name}/{case_name}");
        rendered += 1;
        if check_ids {
            check_tokenization(
                &format!("{name}/{case_name}"),
                &text,
                &ids(case, "input_ids")?,
            )?;
        }
    }
    println!("{name}: {rendered} conversations render identically");
    Ok(())
}

fn check_tokenization(label: &str, text: &str, expected: &[u32]) -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let got = tokenizer.encode(text, false)?;
    assert_eq!(
        got,
        expected,
        "{label}: {}",
        first_difference(&got, expected)
    );
    for token in SINGLE_ID_TOKENS {
        let id = tokenizer
            .token_to_id(token)
            .ok_or_else(|| format!("{token} missing from the vocabulary"))?;
        let in_text = text.matches(token).count();
        let in_ids = got.iter().filter(|&&x| x == id).count();
        assert_eq!(
            in_text, in_ids,
            "{label}: {token} occurs {in_text} times in the text"
        );
    }
    Ok(())
}

#[test]
fn gemma4_31b_template_matches_transformers() -> TestResult {
    check_fixture("gemma4-31b-it", true)
}

#[test]
fn gemma4_31b_interleaved_template_matches_transformers() -> TestResult {
    check_fixture("gemma4-31b-it-interleaved", true)
}

#[test]
fn gemma4_gguf_embedded_template_matches_transformers() -> TestResult {
    check_fixture("gemma4-vocab-gguf-26b-a4b", true)
}

#[test]
fn gemma3_template_matches_transformers() -> TestResult {
    check_fixture("gemma3", false)
}

#[test]
fn every_marker_token_is_exercised() -> TestResult {
    // Guards the fixture set itself: each token above must occur somewhere.
    let fixture = read_json(&fixture_dir().join("templates").join("gemma4-31b-it.json"))?;
    let all_text: String = array(&fixture, "cases")?
        .iter()
        .filter_map(|c| c.get("text").and_then(Value::as_str))
        .collect();
    for token in SINGLE_ID_TOKENS {
        assert!(all_text.contains(token), "no case renders {token}");
    }
    Ok(())
}

#[test]
fn real_vocab_conversations_match_the_oracle() -> TestResult {
    let fixture = read_json(&fixture_dir().join("real_vocab_conversations.json"))?;
    let source = read_text(&fixture_dir().join(string(&fixture, "template_file")?))?;
    let tokenizer = gemma4_tokenizer()?;
    let template = ChatTemplate::for_tokenizer(tokenizer, Some(&source))?;
    for conversation in array(&fixture, "conversations")? {
        let name = string(conversation, "name")?;
        let messages = conversation.get("messages").ok_or("no messages")?;
        let tools = conversation.get("tools").filter(|t| !t.is_null());
        let kwargs = conversation
            .get("template_kwargs")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let text = template.render(messages, tools, true, &kwargs)?;
        assert_eq!(text, string(conversation, "text")?, "{name}");
        check_tokenization(name, &text, &ids(conversation, "input_ids")?)?;
    }
    Ok(())
}

#[test]
fn an_empty_conversation_is_rejected() -> TestResult {
    let fixture = read_json(&fixture_dir().join("templates").join("gemma4-31b-it.json"))?;
    let template = load_template(&fixture)?;
    let result = template.render(&Value::Array(Vec::new()), None, true, &Map::new());
    assert!(
        matches!(result, Err(TextError::TemplateInput(_))),
        "{result:?}"
    );
    Ok(())
}

#[test]
fn jinja_snippets_match_python() -> TestResult {
    let fixture = read_json(&fixture_dir().join("templates").join("snippets.json"))?;
    let messages = fixture.get("messages").ok_or("no messages")?;
    let kwargs = fixture
        .get("kwargs")
        .and_then(Value::as_object)
        .cloned()
        .ok_or("no kwargs")?;
    let mut failures = Vec::new();
    let snippets = array(&fixture, "snippets")?;
    for snippet in snippets {
        let source = string(snippet, "template")?;
        let expected = string(snippet, "text")?;
        let got = ChatTemplate::new(source)
            .and_then(|t| t.render(messages, None, false, &kwargs))
            .unwrap_or_else(|e| format!("ERROR {e}"));
        if got != expected {
            failures.push(format!(
                "{source}\n  python: {expected:?}\n  ours:   {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{} Jinja snippets render identically", snippets.len());
    Ok(())
}
