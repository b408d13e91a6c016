//! Property tests of the Gemma 4 output protocol on hostile model output:
//! arbitrary mixes of protocol markers, DSL punctuation and text, fed to the
//! output processor whole and token by token. It must never panic, and the
//! streamed parse must give the same message as the whole one.

use std::sync::Arc;

use gemma4_text::{AssistantMessage, ProtocolTokens, TextOutput, Tokenizer, TurnParser};
use proptest::prelude::*;

fn tokenizer() -> Arc<Tokenizer> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle/e-style");
    Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"))
}

/// Model output made of protocol markers, call syntax and free text.
fn hostile_turn() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-z ]{0,5}",
        Just("<|tool_call>".to_string()),
        Just("<tool_call|>".to_string()),
        Just("call:".to_string()),
        Just("call:f{".to_string()),
        Just("<|\"|>".to_string()),
        Just("<|channel>thought\n".to_string()),
        Just("<channel|>".to_string()),
        Just("<|tool_response>".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("\"".to_string()),
        Just("-1.5e3".to_string()),
        Just("true".to_string()),
        Just("🦀".to_string()),
    ];
    prop::collection::vec(piece, 0..16).prop_map(|p| p.concat())
}

fn parse(tok: &Arc<Tokenizer>, ids: &[u32], whole: bool) -> Result<AssistantMessage, String> {
    let protocol = ProtocolTokens::new(tok);
    let mut output = TextOutput::new(tok.clone(), protocol.clone(), &[]);
    let mut parser = TurnParser::new(&protocol, &[], "call_".into());
    let mut events = Vec::new();
    let mut held = Vec::new();
    for &id in ids {
        let pieces = output.push(id).map_err(|e| e.to_string())?.pieces;
        if whole {
            // Every piece held back until the end.
            held.extend(pieces);
        } else {
            pieces.iter().for_each(|p| parser.push(p, &mut events));
        }
    }
    held.extend(output.finish().map_err(|e| e.to_string())?.pieces);
    held.iter().for_each(|p| parser.push(p, &mut events));
    parser.finish(&mut events);
    Ok(AssistantMessage::from_events(&events))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_output_parses_the_same_streamed_and_whole(text in hostile_turn()) {
        let tok = tokenizer();
        let ids = tok.encode(&text, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let whole = parse(&tok, &ids, true).map_err(TestCaseError::fail)?;
        let streamed = parse(&tok, &ids, false).map_err(TestCaseError::fail)?;
        prop_assert_eq!(whole, streamed);
    }
}
