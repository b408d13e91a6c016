//! A request's text output: incremental detokenization (never half a UTF-8
//! character) and stop strings (text is held back while it could still be
//! the start of one, and cut before a match).
//!
//! The work per token is bounded by the stop strings' limits, not by the
//! output so far: only the held-back tail (shorter than the longest stop
//! string) plus the new text is searched, with one multi-pattern automaton.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use gemma4_text::{IncrementalDecoder, Tokenizer};

use crate::api::SamplingParams;

pub struct OutputState {
    decoder: IncrementalDecoder<Arc<Tokenizer>>,
    stops: Option<StopStrings>,
    held: String,
    stopped: bool,
}

/// The stop strings of a request: a matcher and, sorted, the strings themselves
/// (to find the longest held-back tail that could still grow into one).
struct StopStrings {
    matcher: AhoCorasick,
    sorted: Vec<String>,
    longest: usize,
}

impl StopStrings {
    fn new(strings: &[String]) -> Option<Self> {
        let mut sorted: Vec<String> = strings.iter().filter(|s| !s.is_empty()).cloned().collect();
        sorted.sort();
        sorted.dedup();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(&sorted)
            .ok()?;
        let longest = sorted.iter().map(String::len).max()?;
        Some(Self {
            matcher,
            sorted,
            longest,
        })
    }

    /// Where the earliest stop string starts in `text`.
    fn find(&self, text: &str) -> Option<usize> {
        self.matcher.find(text).map(|m| m.start())
    }

    /// The byte length of the longest suffix of `text` that is a proper prefix of a stop string.
    fn pending_tail(&self, text: &str) -> usize {
        let from = text.len().saturating_sub(self.longest - 1);
        // The earliest start is the longest tail; only the last `longest - 1` bytes can qualify.
        for (start, _) in text.char_indices().filter(|&(i, _)| i >= from) {
            let tail = &text[start..];
            let at = self.sorted.partition_point(|s| s.as_str() < tail);
            if self.sorted.get(at).is_some_and(|s| s.starts_with(tail)) {
                return tail.len();
            }
        }
        0
    }
}

impl OutputState {
    pub fn new(tokenizer: Arc<Tokenizer>, params: &SamplingParams) -> Self {
        Self {
            decoder: IncrementalDecoder::new(tokenizer),
            stops: StopStrings::new(&params.stop_strings),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds a token; returns the text that may be shown now and whether a stop string matched.
    pub fn push(&mut self, token: u32) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if let Ok(Some(t)) = self.decoder.push(token) {
            self.held.push_str(&t);
        }
        self.release()
    }

    fn release(&mut self) -> (String, bool) {
        let Some(stops) = &self.stops else {
            return (std::mem::take(&mut self.held), false);
        };
        if let Some(at) = stops.find(&self.held) {
            let out = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return (out, true);
        }
        // Hold back the longest tail that could still grow into a stop string.
        let cut = self.held.len() - stops.pending_tail(&self.held);
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The text still held at the end of the request.
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        if let Ok(Some(t)) = self.decoder.finish() {
            self.held.push_str(&t);
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> StopStrings {
        let owned: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        StopStrings::new(&owned).expect("stop strings")
    }

    #[test]
    fn the_earliest_match_wins_and_tails_are_held() {
        let s = stops(&["world", "lo w", "xyz"]);
        assert_eq!(s.find("hello world"), Some(3));
        assert_eq!(s.find("hello"), None);
        // "lo" could become "lo w"; "wor" could become "world"; "xy" could become "xyz".
        assert_eq!(s.pending_tail("hello"), 2);
        assert_eq!(s.pending_tail("a wor"), 3);
        assert_eq!(s.pending_tail("axy"), 2);
        assert_eq!(s.pending_tail("abc"), 0);
        // A whole stop string is a match, not a pending tail.
        assert_eq!(stops(&["ab"]).pending_tail("xab"), 0);
        assert!(StopStrings::new(&[String::new()]).is_none());
    }

    #[test]
    fn multibyte_tails_are_cut_on_character_boundaries() {
        let s = stops(&["é!"]);
        assert_eq!(s.pending_tail("café"), "é".len());
        assert_eq!(s.find("café!"), Some(3));
    }
}
