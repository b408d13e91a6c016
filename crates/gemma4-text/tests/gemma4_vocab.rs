//! The real Gemma 4 tokenizer rebuilt from llama.cpp's vocabulary GGUF, checked
//! against llama.cpp's own tokenizer test cases and against the reference
//! `tokenizer.json` (ids and decoded text produced by Hugging Face tokenizers).

mod common;

use common::{array, fixture_dir, gemma4_tokenizer, gemma4_vocab_gguf, ids, read_json, string};
use common::{first_difference, read_text, Fallible, TestResult};
use gemma4_text::{gguf_add_bos_token, gguf_chat_template, IncrementalDecoder, MARKUP_TOKENS};

/// llama.cpp's `.inp` format: cases separated by `\n__ggml_vocab_test__\n`.
fn llama_cpp_cases() -> Fallible<Vec<(String, Vec<u32>)>> {
    let dir = fixture_dir();
    let inputs = read_text(&dir.join("ggml-vocab-gemma-4.gguf.inp"))?;
    let outputs = read_text(&dir.join("ggml-vocab-gemma-4.gguf.out"))?;
    let texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<&str> = outputs.lines().collect();
    if texts.len() != expected.len() {
        return Err(format!("{} inputs but {} outputs", texts.len(), expected.len()).into());
    }
    texts
        .iter()
        .zip(&expected)
        .map(|(text, line)| {
            let ids = line
                .split_whitespace()
                .map(str::parse::<u32>)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(((*text).to_owned(), ids))
        })
        .collect()
}

#[test]
fn all_llama_cpp_cases_match() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let cases = llama_cpp_cases()?;
    assert_eq!(cases.len(), 46, "the llama.cpp test file has 46 cases");
    let mut failures = Vec::new();
    for (text, expected) in &cases {
        let got = tokenizer.encode(text, false)?;
        if &got != expected {
            failures.push(format!("{text:?}: {}", first_difference(&got, expected)));
        }
    }
    println!(
        "{} of {} llama.cpp cases match",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
    Ok(())
}

#[test]
fn matches_reference_tokenizer_json() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let fixture = read_json(&fixture_dir().join("real_vocab_tokenizer_cases.json"))?;
    let cases = array(&fixture, "cases")?;
    for case in cases {
        let text = string(case, "text")?;
        let expected = ids(case, "input_ids")?;
        let got = tokenizer.encode(text, false)?;
        assert_eq!(
            got,
            expected,
            "{text:?}: {}",
            first_difference(&got, &expected)
        );
        assert_eq!(
            tokenizer.decode(&expected, false)?,
            string(case, "decoded")?,
            "decode of {text:?}"
        );
        assert_eq!(
            tokenizer.decode(&expected, true)?,
            string(case, "decoded_skip_special")?,
            "decode (skipping special tokens) of {text:?}"
        );
    }
    println!("{} reference tokenizer.json cases match", cases.len());
    Ok(())
}

#[test]
fn no_bos_is_added_and_the_file_flag_is_reported() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    assert!(!tokenizer.add_bos_token());
    assert_eq!(
        tokenizer.encode("Hello", true)?,
        tokenizer.encode("Hello", false)?
    );
    assert_eq!(gguf_add_bos_token(&gemma4_vocab_gguf())?, Some(true));
    assert_eq!(tokenizer.bos_token(), Some("<bos>"));
    assert_eq!(tokenizer.eos_token(), Some("<eos>"));
    assert_eq!(tokenizer.bos_id(), tokenizer.token_to_id("<bos>"));
    assert_eq!(tokenizer.vocab_size(), 262_144);
    Ok(())
}

#[test]
fn stop_ids_are_those_of_the_generation_config() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let config = read_json(&fixture_dir().join("real_vocab_generation_config.json"))?;
    let expected = ids(&config, "eos_token_id")?;
    assert_eq!(tokenizer.stop_token_ids(), expected);
    Ok(())
}

#[test]
fn embedded_chat_template_is_read() -> TestResult {
    let expected = read_text(
        &fixture_dir()
            .join("templates")
            .join("from-vocab-gguf-26B-A4B.jinja"),
    )?;
    let from_file = gguf_chat_template(&gemma4_vocab_gguf())?;
    assert_eq!(from_file.as_deref(), Some(expected.as_str()));
    assert_eq!(gemma4_tokenizer()?.chat_template(), Some(expected.as_str()));
    Ok(())
}

#[test]
fn markup_tokens_are_single_ids_and_stay_visible() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    for token in MARKUP_TOKENS {
        let id = tokenizer
            .token_to_id(token)
            .ok_or_else(|| format!("{token} is not in the vocabulary"))?;
        assert_eq!(tokenizer.encode(token, false)?, vec![id], "{token}");
        assert_eq!(tokenizer.decode_visible(&[id])?, token);
    }
    for hidden in ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|think|>"] {
        let id = tokenizer
            .token_to_id(hidden)
            .ok_or_else(|| format!("{hidden} is not in the vocabulary"))?;
        assert_eq!(tokenizer.decode_visible(&[id])?, "", "{hidden}");
    }
    Ok(())
}

/// The reference decoding with the control tokens that streaming hides removed.
fn without_hidden_tokens(text: &str) -> String {
    let hidden = [
        "<bos>",
        "<eos>",
        "<pad>",
        "<unk>",
        "<mask>",
        "<|turn>",
        "<turn|>",
        "<|think|>",
        "<|image>",
        "<|image|>",
        "<image|>",
        "<|audio>",
        "<|audio|>",
        "<audio|>",
        "<|video|>",
    ];
    hidden
        .iter()
        .fold(text.to_owned(), |acc, token| acc.replace(token, ""))
}

#[test]
fn streaming_never_splits_characters() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let fixture = read_json(&fixture_dir().join("real_vocab_tokenizer_cases.json"))?;
    for case in array(&fixture, "cases")? {
        let reference = string(case, "decoded")?;
        let mut decoder = IncrementalDecoder::new(tokenizer);
        let mut streamed = String::new();
        for id in ids(case, "input_ids")? {
            if let Some(piece) = decoder.push(id)? {
                assert!(
                    !piece.contains('\u{FFFD}') || reference.contains('\u{FFFD}'),
                    "a piece of {reference:?} holds a broken character: {piece:?}"
                );
                streamed.push_str(&piece);
            }
        }
        if let Some(rest) = decoder.finish()? {
            streamed.push_str(&rest);
        }
        assert_eq!(streamed, without_hidden_tokens(reference));
    }
    Ok(())
}

#[test]
fn byte_fallback_characters_arrive_whole() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    // U+3400 and U+20000 are not in the vocabulary: 3 and 4 byte tokens each.
    let text = "a\u{3400}\u{20000}b";
    let token_ids = tokenizer.encode(text, false)?;
    let byte_tokens = token_ids
        .iter()
        .filter_map(|&id| tokenizer.id_to_token(id))
        .filter(|t| t.starts_with("<0x"))
        .count();
    assert_eq!(byte_tokens, 7, "ids {token_ids:?}");
    let mut decoder = IncrementalDecoder::new(tokenizer);
    let mut pieces = Vec::new();
    for id in token_ids {
        if let Some(piece) = decoder.push(id)? {
            pieces.push(piece);
        }
    }
    assert_eq!(decoder.finish()?, None);
    assert_eq!(pieces.concat(), text);
    // The run of byte tokens arrives once it has ended, never a broken character.
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(
        pieces.last().map(String::as_str),
        Some("\u{3400}\u{20000}b"),
        "{pieces:?}"
    );
    Ok(())
}

#[test]
fn a_byte_run_that_is_not_utf8_streams_as_the_whole_decode_shows_it() -> TestResult {
    // `E`, `4`, then a byte that can never start a character: the decoder
    // replaces every byte of such a run, so the stream must not show `E4`
    // before the run has ended.
    let tokenizer = gemma4_tokenizer()?;
    let byte = |b: &str| tokenizer.token_to_id(b).ok_or(format!("no {b} token"));
    let ids = [byte("<0x45>")?, byte("<0x34>")?, byte("<0xF6>")?];
    let whole = tokenizer.decode(&ids, false)?;
    assert_eq!(whole, "\u{FFFD}\u{FFFD}\u{FFFD}");
    for tail in [None, tokenizer.encode("ok", false)?.first().copied()] {
        let mut decoder = IncrementalDecoder::new(tokenizer);
        let mut streamed = String::new();
        for &id in ids.iter().chain(tail.as_ref()) {
            if let Some(piece) = decoder.push(id)? {
                streamed.push_str(&piece);
            }
        }
        if let Some(rest) = decoder.finish()? {
            streamed.push_str(&rest);
        }
        let all: Vec<u32> = ids.iter().copied().chain(tail).collect();
        assert_eq!(streamed, tokenizer.decode(&all, false)?, "tail {tail:?}");
    }
    Ok(())
}

#[test]
fn an_unfinished_character_is_flushed_by_finish() -> TestResult {
    let tokenizer = gemma4_tokenizer()?;
    let first_byte = tokenizer.token_to_id("<0xE3>").ok_or("no <0xE3> token")?;
    let mut decoder = IncrementalDecoder::new(tokenizer);
    assert_eq!(decoder.push(first_byte)?, None);
    assert_eq!(decoder.finish()?, Some("\u{FFFD}".to_owned()));
    assert_eq!(decoder.finish()?, None);
    Ok(())
}
