//! A request's output, from sampled ids to what a caller may show: each id
//! is detokenized once (never half a UTF-8 character), stop strings are
//! matched on the text (held back while it could still be the start of one,
//! cut before a match), and a chat turn is parsed into typed events.
//!
//! The Gemma 4 markers are told apart by id, never by text: the decoder is
//! flushed before each one and its spelling is laid into the text as a unit,
//! so released text comes as [`Piece`]s that the [`TurnParser`] reads as they
//! are, and a stop string never releases half a marker.
//!
//! The work per token is bounded by the stop strings' limits, not by the
//! output so far: only the held-back tail (shorter than the longest stop
//! string) plus the new text is searched, with one multi-pattern automaton.

use std::collections::VecDeque;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::detok::IncrementalDecoder;
use crate::error::Result;
use crate::protocol::{ChannelState, Marker, OutputEvent, ProtocolTokens, TurnParser};
use crate::tokenizer::Tokenizer;

/// Released output: answer text, or a protocol marker (whose spelling is in
/// the released text too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Marker(Marker),
}

/// The stop strings of a request: a matcher and, sorted, the strings themselves
/// (to find the longest held-back tail that could still grow into one).
struct StopStrings {
    matcher: AhoCorasick,
    sorted: Vec<String>,
    longest: usize,
}

impl std::fmt::Debug for StopStrings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.sorted).finish()
    }
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

    /// Where the earliest stop string starts in `text`, and which it is.
    fn find(&self, text: &str) -> Option<(usize, &str)> {
        self.matcher
            .find(text)
            .map(|m| (m.start(), self.sorted[m.pattern().as_usize()].as_str()))
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

/// Text released for one id (or at the end).
#[derive(Debug, Default)]
pub struct Released {
    /// The text, marker spellings included.
    pub text: String,
    /// The same text as answer stretches and markers.
    pub pieces: Vec<Piece>,
    /// The stop string that matched: nothing more will be released.
    pub stopped: Option<String>,
}

/// Detokenizes one request's ids and applies its stop strings.
#[derive(Debug)]
pub struct TextOutput {
    tokens: ProtocolTokens,
    /// Decodes the text since the last marker.
    decoder: IncrementalDecoder<Arc<Tokenizer>>,
    stops: Option<StopStrings>,
    /// Decoded, not yet released.
    held: String,
    /// Where each marker in `held` starts, in order.
    markers: VecDeque<(usize, Marker)>,
    stopped: bool,
}

impl TextOutput {
    pub fn new(tokenizer: Arc<Tokenizer>, tokens: ProtocolTokens, stop_strings: &[String]) -> Self {
        Self {
            decoder: IncrementalDecoder::new(tokenizer),
            tokens,
            stops: StopStrings::new(stop_strings),
            held: String::new(),
            markers: VecDeque::new(),
            stopped: false,
        }
    }

    /// Adds an id; returns what may be shown now.
    pub fn push(&mut self, id: u32) -> Result<Released> {
        let marker = self.tokens.marker(id);
        self.push_read(id, marker)
    }

    /// As [`push`](Self::push), for an id whose marker the caller has looked up.
    fn push_read(&mut self, id: u32, marker: Option<Marker>) -> Result<Released> {
        if self.stopped {
            return Ok(Released::default());
        }
        match marker {
            Some(marker) => {
                self.flush_decoder()?;
                self.markers.push_back((self.held.len(), marker));
                self.held.push_str(marker.as_str());
            }
            None => {
                if let Some(text) = self.decoder.push(id)? {
                    self.held.push_str(&text);
                }
            }
        }
        Ok(self.release())
    }

    /// Everything still held at the end of the request.
    pub fn finish(&mut self) -> Result<Released> {
        if self.stopped {
            return Ok(Released::default());
        }
        self.flush_decoder()?;
        Ok(self.cut(self.held.len(), None))
    }

    fn flush_decoder(&mut self) -> Result<()> {
        if let Some(text) = self.decoder.finish()? {
            self.held.push_str(&text);
        }
        self.decoder.reset();
        Ok(())
    }

    fn release(&mut self) -> Released {
        let Some(stops) = &self.stops else {
            return self.cut(self.held.len(), None);
        };
        if let Some((at, stop)) = stops.find(&self.held) {
            let stop = stop.to_owned();
            return self.cut(at, Some(stop));
        }
        // Hold back the longest tail that could still grow into a stop string.
        let at = self.held.len() - stops.pending_tail(&self.held);
        self.cut(at, None)
    }

    /// Releases `held[..at]`, never part of a marker; with the `stop` string
    /// that matched there, drops the rest.
    fn cut(&mut self, at: usize, stop: Option<String>) -> Released {
        let at = self
            .markers
            .iter()
            .find(|(start, m)| *start < at && at < start + m.as_str().len())
            .map_or(at, |(start, _)| *start);
        let mut pieces = Vec::new();
        let mut from = 0;
        while let Some(&(start, marker)) = self.markers.front().filter(|(s, _)| *s < at) {
            if start > from {
                pieces.push(Piece::Text(self.held[from..start].to_owned()));
            }
            pieces.push(Piece::Marker(marker));
            from = start + marker.as_str().len();
            self.markers.pop_front();
        }
        if at > from {
            pieces.push(Piece::Text(self.held[from..at].to_owned()));
        }
        let text: String = self.held.drain(..at).collect();
        for (start, _) in self.markers.iter_mut() {
            *start -= at;
        }
        if stop.is_some() {
            self.held.clear();
            self.markers.clear();
            self.stopped = true;
        }
        Released {
            text,
            pieces,
            stopped: stop,
        }
    }
}

/// One step of a request's output.
#[derive(Debug, Default)]
pub struct OutputStep {
    pub text: String,
    /// The chat turn's events (none when the output is read as plain text).
    pub events: Vec<OutputEvent>,
    /// The stop string that matched.
    pub stopped: Option<String>,
}

/// How a request's output is read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Reading {
    /// Plain text (completions).
    #[default]
    Text,
    /// A chat turn: reasoning, tool calls (ids `{call_id_prefix}{n}`) and answer.
    Chat { call_id_prefix: String },
}

/// One request's output: text, stop strings and, for chat turns, the parsed turn.
#[derive(Debug)]
pub struct RequestOutput {
    text: TextOutput,
    channel: ChannelState,
    parser: Option<TurnParser>,
    reasoning_tokens: usize,
}

impl RequestOutput {
    /// The output of a completion of `prompt`.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        tokens: ProtocolTokens,
        prompt: &[u32],
        stop_strings: &[String],
        reading: &Reading,
    ) -> Self {
        let parser = match reading {
            Reading::Text => None,
            Reading::Chat { call_id_prefix } => {
                Some(TurnParser::new(&tokens, prompt, call_id_prefix.clone()))
            }
        };
        Self {
            channel: ChannelState::after_prompt(tokens.clone(), prompt),
            text: TextOutput::new(tokenizer, tokens, stop_strings),
            parser,
            reasoning_tokens: 0,
        }
    }

    /// Adds a generated id.
    pub fn push(&mut self, id: u32) -> Result<OutputStep> {
        let marker = self.channel.accept(id);
        if marker.is_none() && self.channel.in_thought() {
            self.reasoning_tokens += 1;
        }
        let released = self.text.push_read(id, marker)?;
        Ok(self.parse(released, false))
    }

    /// The request ended: what is still held.
    pub fn finish(&mut self) -> Result<OutputStep> {
        let released = self.text.finish()?;
        Ok(self.parse(released, true))
    }

    fn parse(&mut self, released: Released, end: bool) -> OutputStep {
        let mut events = Vec::new();
        if let Some(parser) = self.parser.as_mut() {
            for piece in &released.pieces {
                parser.push(piece, &mut events);
            }
            if end || released.stopped.is_some() {
                parser.finish(&mut events);
            }
        }
        OutputStep {
            text: released.text,
            events,
            stopped: released.stopped,
        }
    }

    /// Generated ids inside thought channels so far.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Tool calls the turn completed (0 for plain text).
    pub fn completed_calls(&self) -> usize {
        self.parser.as_ref().map_or(0, TurnParser::completed_calls)
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
        assert_eq!(s.find("hello world"), Some((3, "lo w")));
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
        assert_eq!(s.find("café!"), Some((3, "é!")));
    }
}
