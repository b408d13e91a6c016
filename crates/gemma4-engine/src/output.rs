//! A request's text output: incremental detokenization (never half a UTF-8
//! character) and stop strings (text is held back while it could still be
//! the start of one, and cut before a match).

use std::sync::Arc;

use gemma4_text::{IncrementalDecoder, Tokenizer};

use crate::api::SamplingParams;

pub struct OutputState {
    decoder: IncrementalDecoder<Arc<Tokenizer>>,
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl OutputState {
    pub fn new(tokenizer: Arc<Tokenizer>, params: &SamplingParams) -> Self {
        let stops = params
            .stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        Self {
            decoder: IncrementalDecoder::new(tokenizer),
            stops,
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
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return (out, true);
        }
        // Hold back the longest tail that could still grow into a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
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
