//! Streaming detokenization: turning generated ids into text one id at a time.
//!
//! Decoding ids one by one is wrong for two reasons: a character may be spread
//! over several byte-fallback tokens (`<0xE2>` `<0x98>` `<0x83>` is `☃`), and the
//! decoder's output for a token can depend on its neighbours. So the decoder
//! keeps a short window of recent ids, decodes the window with and without the
//! new ids, and emits the difference once it no longer ends in an incomplete
//! character (U+FFFD, which is what a partial UTF-8 sequence decodes to).
//!
//! A run of byte-fallback tokens is held until it ends: the decoder turns every
//! byte of a run that is not UTF-8 as a whole into U+FFFD, so bytes that look
//! complete on their own may still be replaced by a later byte of the run.
//! Held whole, the streamed text equals the decode of all the ids.

use std::borrow::Borrow;
use std::collections::HashSet;

use crate::error::Result;
use crate::tokenizer::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';

/// Turns a stream of generated ids into a stream of text pieces.
///
/// Control tokens (`<bos>`, `<eos>`, `<turn|>`, ...) produce no text. The Gemma 4
/// tool-call and thinking markers (`<|tool_call>`, `<|"|>`, `<|channel>`, ...)
/// appear in the text so that downstream parsers can find them.
///
/// `T` is anything that lends a [`Tokenizer`]: `&Tokenizer`, `Arc<Tokenizer>`, ...
#[derive(Debug)]
pub struct IncrementalDecoder<T: Borrow<Tokenizer>> {
    tokenizer: T,
    hidden: HashSet<u32>,
    /// `<0x00>` … `<0xFF>`: byte-fallback tokens.
    byte_tokens: HashSet<u32>,
    ids: Vec<u32>,
    /// Start of the context window: ids before it are never decoded again.
    prefix_offset: usize,
    /// Ids before this have had their text emitted.
    read_offset: usize,
}

impl<T: Borrow<Tokenizer>> IncrementalDecoder<T> {
    /// A decoder with no ids yet.
    pub fn new(tokenizer: T) -> Self {
        let hidden = tokenizer.borrow().hidden_token_ids();
        let byte_tokens = (0..=255u8)
            .filter_map(|b| tokenizer.borrow().token_to_id(&format!("<0x{b:02X}>")))
            .collect();
        IncrementalDecoder {
            tokenizer,
            hidden,
            byte_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one generated id; returns the text it completes, if any.
    ///
    /// `None` means the id produced no complete character yet (part of a
    /// multi-byte character) or no text at all (a hidden control token).
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        if self.hidden.contains(&id) {
            return Ok(None);
        }
        self.ids.push(id);
        if self.byte_tokens.contains(&id) {
            // The run may not have ended (see the module notes).
            return Ok(None);
        }
        let (emitted, text) = self.pending_text()?;
        if text.len() > emitted.len() && !text.ends_with(REPLACEMENT) {
            let delta = new_suffix(&emitted, &text);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Emits whatever is still held back (for instance an incomplete byte
    /// sequence at the end of generation, shown as U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let (emitted, text) = self.pending_text()?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        let delta = new_suffix(&emitted, &text);
        Ok((!delta.is_empty()).then_some(delta))
    }

    /// Starts afresh (after [`finish`](Self::finish)): the next id is decoded
    /// with no context before it. Cheaper than a new decoder, whose sets of
    /// hidden and byte tokens take a lookup per token.
    pub fn reset(&mut self) {
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
    }

    /// Every id pushed so far, hidden control tokens excluded.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Text of the window up to the read offset, and of the whole window.
    fn pending_text(&self) -> Result<(String, String)> {
        let tokenizer = self.tokenizer.borrow();
        let emitted = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let text = tokenizer.decode(&self.ids[self.prefix_offset..], false)?;
        Ok((emitted, text))
    }
}

/// The part of `text` after `emitted`. If `text` does not start with `emitted`
/// (a decoder that rewrites earlier text), the part after their common prefix.
fn new_suffix(emitted: &str, text: &str) -> String {
    if let Some(rest) = text.strip_prefix(emitted) {
        return rest.to_owned();
    }
    let common = emitted
        .char_indices()
        .zip(text.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(emitted.len().min(text.len()));
    text.get(common..).unwrap_or("").to_owned()
}

#[cfg(test)]
mod tests {
    use super::new_suffix;

    #[test]
    fn suffix_after_prefix() {
        assert_eq!(new_suffix("ab", "abc"), "c");
        assert_eq!(new_suffix("", "☃"), "☃");
        assert_eq!(new_suffix("a\u{FFFD}", "a☃x"), "☃x");
    }
}
