//! Property tests of the text side on hostile input: the tokenizer on
//! arbitrary text and ids, the chat template on messages that carry
//! template syntax and control tokens, and the GGUF metadata reader on
//! corrupt headers. None may panic; message text is never evaluated as
//! template code.

use std::path::PathBuf;

use gemma4_text::{ChatTemplate, GgufMetadata, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Map};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/e-style")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&fixture()).expect("tokenizer")
}

/// Text made of pieces a tokenizer or template may choke on.
fn hostile_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        ".{0,6}",
        Just("{{ 7 * 7 }}".to_string()),
        Just("{% for x in range(99999999) %}".to_string()),
        Just("{# #}".to_string()),
        Just("<|turn>".to_string()),
        Just("<turn|>".to_string()),
        Just("<bos>".to_string()),
        Just("<eos>".to_string()),
        Just("\u{0}\u{feff}\u{202e}".to_string()),
        Just("\r\n\t".to_string()),
        Just("🦀é\u{301}".to_string()),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn the_tokenizer_takes_any_text(text in hostile_text(), bos in any::<bool>()) {
        let tok = tokenizer();
        let ids = tok.encode(&text, bos).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        let _ = tok.decode(&ids, false);
    }

    #[test]
    fn the_tokenizer_decodes_any_ids(ids in prop::collection::vec(0u32..600, 0..64)) {
        let tok = tokenizer();
        let _ = tok.decode(&ids, false);
        let _ = tok.decode(&ids, true);
        let _ = tok.decode_visible(&ids);
    }

    #[test]
    fn hostile_messages_render_literally(
        turns in prop::collection::vec((prop::sample::select(vec!["user", "assistant", "system", "tool", "x"]), hostile_text()), 1..5),
        generation_prompt in any::<bool>(),
    ) {
        let tok = tokenizer();
        let template = ChatTemplate::for_tokenizer(&tok, None).expect("template");
        let messages: Vec<_> = turns.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
        if let Ok(text) = template.render(&json!(messages), None, generation_prompt, &Map::new()) {
            for (_, content) in &turns {
                // Templates may trim, but never evaluate: the text stays as written.
                let trimmed = content.trim();
                prop_assert!(text.contains(trimmed), "{trimmed:?} is not in {text:?}");
            }
        }
    }
}

/// A GGUF header: magic, version, tensor count, then `kvs` raw key/value bytes.
fn gguf(version: u32, kv_count: u64, kvs: &[u8]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&kv_count.to_le_bytes());
    out.extend_from_slice(kvs);
    out
}

/// One key/value entry whose lengths and type ids are drawn at random.
fn kv_entry() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![0u64..16, Just(u64::MAX), Just(1 << 40)],
        prop_oneof![0u32..14, Just(u32::MAX)],
        prop_oneof![0u64..8, Just(u64::MAX), Just(1 << 33)],
        prop::collection::vec(any::<u8>(), 0..48),
    )
        .prop_map(|(key_len, ty, len, tail)| {
            let mut e = key_len.to_le_bytes().to_vec();
            e.extend(std::iter::repeat_n(b'k', key_len.min(16) as usize));
            e.extend_from_slice(&ty.to_le_bytes());
            // For strings and arrays this is a length; for scalars, data.
            e.extend_from_slice(&9u32.min(ty).to_le_bytes());
            e.extend_from_slice(&len.to_le_bytes());
            e.extend(tail);
            e
        })
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn corrupt_gguf_headers_are_errors(
        version in prop_oneof![Just(3u32), Just(2), any::<u32>()],
        kv_count in prop_oneof![0u64..6, Just(u64::MAX)],
        entries in prop::collection::vec(kv_entry(), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = gguf(version, kv_count, &entries.concat());
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep.max(4));
        let path = std::env::temp_dir().join(format!("gemma4-fuzz-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes).expect("write");
        let _ = GgufMetadata::read(&path);
        let _ = std::fs::remove_file(&path);
    }
}
