//! The tiny oracle checkpoints' tokenizers and simplified chat templates, against
//! the `tokenizer_cases` and `chat_template_cases` transformers produced for them.

mod common;

use common::{array, first_difference, ids, oracle_dir, read_json, string, TestResult};
use gemma4_text::{ChatTemplate, TextError, Tokenizer};
use serde_json::{Map, Value};

const VARIANTS: [&str; 4] = ["e-style", "dense-k-eq-v", "moe", "unified"];

#[test]
fn tokenizer_cases_match() -> TestResult {
    for variant in VARIANTS {
        let dir = oracle_dir(variant);
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let cases = read_json(&dir.join("cases.json"))?;
        for case in array(&cases, "tokenizer_cases")? {
            let text = string(case, "text")?;
            let add_special = case
                .get("add_special_tokens")
                .and_then(Value::as_bool)
                .ok_or("case without add_special_tokens")?;
            let expected = ids(case, "input_ids")?;
            let got = tokenizer.encode(text, add_special)?;
            assert_eq!(
                got,
                expected,
                "{variant} {text:?}: {}",
                first_difference(&got, &expected)
            );
        }
    }
    Ok(())
}

#[test]
fn chat_template_cases_match() -> TestResult {
    for variant in VARIANTS {
        let dir = oracle_dir(variant);
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let template = ChatTemplate::for_tokenizer(&tokenizer, None)?;
        let cases = read_json(&dir.join("cases.json"))?;
        for case in array(&cases, "chat_template_cases")? {
            let messages = case.get("messages").ok_or("case without messages")?;
            let mut kwargs: Map<String, Value> = case
                .get("kwargs")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let add_generation_prompt = kwargs
                .remove("add_generation_prompt")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            let text = template.render(messages, None, add_generation_prompt, &kwargs)?;
            assert_eq!(text, string(case, "text")?, "{variant}");
            let expected = ids(case, "input_ids")?;
            let got = tokenizer.encode(&text, false)?;
            assert_eq!(
                got,
                expected,
                "{variant}: {}",
                first_difference(&got, &expected)
            );
        }
    }
    Ok(())
}

#[test]
fn special_tokens_are_found_by_name() -> TestResult {
    let tokenizer = Tokenizer::from_dir(&oracle_dir("e-style"))?;
    // Ids from the oracle's README: <eos>=1, <bos>=2, <turn|>=106, <|tool_response>=50.
    assert_eq!(tokenizer.bos_id(), Some(2));
    assert_eq!(tokenizer.eos_id(), Some(1));
    assert!(tokenizer.add_bos_token());
    assert_eq!(tokenizer.stop_token_ids(), vec![1, 106, 50]);
    assert_eq!(tokenizer.vocab_size(), 512);
    Ok(())
}

#[test]
fn decode_skips_only_control_tokens() -> TestResult {
    let tokenizer = Tokenizer::from_dir(&oracle_dir("e-style"))?;
    let text = "<|turn>model\n<|tool_call>call:f{}<tool_call|><turn|>";
    let encoded = tokenizer.encode(text, true)?;
    assert_eq!(tokenizer.decode(&encoded, false)?, format!("<bos>{text}"));
    assert_eq!(
        tokenizer.decode_visible(&encoded)?,
        "model\n<|tool_call>call:f{}<tool_call|>"
    );
    Ok(())
}

#[test]
fn a_directory_without_tokenizer_json_is_a_clear_error() {
    let dir = oracle_dir("no-such-variant");
    match Tokenizer::from_dir(&dir) {
        Err(err @ TextError::MissingTokenizerJson { .. }) => {
            assert!(
                err.to_string().starts_with("no tokenizer.json in DIR: "),
                "{err}"
            );
        }
        other => panic!("expected MissingTokenizerJson, got {other:?}"),
    }
}

#[test]
fn a_checkpoint_without_template_needs_one_from_the_user() -> TestResult {
    let dir = std::env::temp_dir().join(format!("gemma4-text-no-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(
        oracle_dir("moe").join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )?;
    let tokenizer = Tokenizer::from_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let tokenizer = tokenizer?;
    assert_eq!(tokenizer.chat_template(), None);
    match ChatTemplate::for_tokenizer(&tokenizer, None) {
        Err(err @ TextError::NoChatTemplate) => {
            assert!(err.to_string().contains("--chat-template FILE"), "{err}");
        }
        other => panic!("expected NoChatTemplate, got {other:?}"),
    }
    let custom =
        ChatTemplate::for_tokenizer(&tokenizer, Some("{{ bos_token }}{{ messages[0].content }}"))?;
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    assert_eq!(
        custom.render(&messages, None, false, &Map::new())?,
        "<bos>hi"
    );
    Ok(())
}
