//! Server-sent events: framing bytes into events, and reading OpenAI stream
//! chunks (`/v1/completions` and `/v1/chat/completions`) out of them.

use serde_json::Value;

/// Splits a byte stream into SSE events and returns each event's `data` payload.
///
/// Lines end in `\n` or `\r\n`; `data:` lines of one event are joined with
/// `\n`; comments (`:`) and other fields (`event:`, `id:`, `retry:`) are skipped;
/// a blank line ends the event. Bytes may arrive split anywhere, even inside a
/// UTF-8 character.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes and returns the data of every event they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &byte in bytes {
            if byte == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                if let Some(event) = self.take_line(&line) {
                    events.push(event);
                }
            } else {
                self.line.push(byte);
            }
        }
        events
    }

    /// Ends the stream: an event still being collected (the server closed the
    /// connection without the final blank line) is returned.
    pub fn finish(&mut self) -> Option<String> {
        let line = std::mem::take(&mut self.line);
        let mut pending = None;
        if !line.is_empty() {
            pending = self.take_line(&line);
        }
        pending.or_else(|| self.data.take())
    }

    fn take_line(&mut self, line: &[u8]) -> Option<String> {
        if line.is_empty() {
            return self.data.take();
        }
        let text = String::from_utf8_lossy(line);
        if text.starts_with(':') {
            return None;
        }
        let (field, value) = match text.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (text.as_ref(), ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            }
        }
        None
    }
}

/// Token counts from a `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
}

impl Usage {
    /// Reads `{"prompt_tokens", "completion_tokens"}`; `None` when the value is
    /// not an object or has neither count.
    pub fn from_json(value: &Value) -> Option<Self> {
        let count = |key: &str| {
            value
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        let usage = Usage {
            prompt_tokens: count("prompt_tokens"),
            completion_tokens: count("completion_tokens"),
        };
        (usage.prompt_tokens.is_some() || usage.completion_tokens.is_some()).then_some(usage)
    }
}

/// What one stream event means.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// `data: [DONE]`.
    Done,
    /// A chunk: whether it carried generated text, and its usage if any.
    Chunk {
        has_text: bool,
        usage: Option<Usage>,
    },
    /// An error object sent inside the stream.
    Error(String),
}

/// Interprets one event payload. Generated text is `choices[].text`
/// (completions) or `choices[].delta.content` / `reasoning_content` /
/// `reasoning` (chat); tool-call deltas also count as generated output.
pub fn interpret(data: &str) -> Result<StreamEvent, String> {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let value: Value = serde_json::from_str(trimmed).map_err(|e| {
        format!(
            "stream event is not JSON ({e}): {}",
            crate::client::snippet(trimmed)
        )
    })?;
    if let Some(error) = value.get("error") {
        return Ok(StreamEvent::Error(error_message(error)));
    }
    let mut has_text = false;
    if let Some(choices) = value.get("choices").and_then(Value::as_array) {
        for choice in choices {
            let non_empty =
                |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
            let delta = choice.get("delta");
            has_text |= non_empty(choice.get("text"))
                || non_empty(delta.and_then(|d| d.get("content")))
                || non_empty(delta.and_then(|d| d.get("reasoning_content")))
                || non_empty(delta.and_then(|d| d.get("reasoning")))
                || delta
                    .and_then(|d| d.get("tool_calls"))
                    .and_then(Value::as_array)
                    .is_some_and(|calls| !calls.is_empty());
        }
    }
    let usage = value.get("usage").and_then(Usage::from_json);
    Ok(StreamEvent::Chunk { has_text, usage })
}

/// The message of an OpenAI-style error value (`{"message": ...}` or a string).
pub fn error_message(error: &Value) -> String {
    match error {
        Value::String(s) => s.clone(),
        Value::Object(map) => map
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| error.to_string()),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_reads_and_crlf() {
        let mut p = SseParser::new();
        let mut events = p.feed(b"data: {\"a\"");
        assert!(events.is_empty());
        events.extend(p.feed(b":1}\r\n\r\ndata: [DO"));
        assert_eq!(events, vec!["{\"a\":1}".to_owned()]);
        events.extend(p.feed(b"NE]\n\n"));
        assert_eq!(events.len(), 2);
        assert_eq!(events[1], "[DONE]");
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn comments_fields_and_multiline_data() {
        let mut p = SseParser::new();
        let events = p.feed(b": keep-alive\nevent: message\nid: 7\ndata: line1\ndata:line2\n\n\n");
        assert_eq!(events, vec!["line1\nline2".to_owned()]);
    }

    #[test]
    fn utf8_split_inside_a_character() {
        let text = "data: {\"text\":\"é\"}\n\n".as_bytes();
        let cut = text.iter().position(|&b| b >= 0x80).unwrap_or(0) + 1;
        let mut p = SseParser::new();
        let mut events = p.feed(&text[..cut]);
        events.extend(p.feed(&text[cut..]));
        assert_eq!(events, vec!["{\"text\":\"é\"}".to_owned()]);
    }

    #[test]
    fn unterminated_event_is_flushed_at_the_end() {
        let mut p = SseParser::new();
        assert!(p.feed(b"data: {\"x\":2}").is_empty());
        assert_eq!(p.finish(), Some("{\"x\":2}".to_owned()));
    }

    #[test]
    fn completion_and_chat_chunks() {
        let c = interpret(r#"{"choices":[{"index":0,"text":"Hi"}]}"#);
        assert_eq!(
            c,
            Ok(StreamEvent::Chunk {
                has_text: true,
                usage: None
            })
        );
        let empty = interpret(r#"{"choices":[{"index":0,"text":""}]}"#);
        assert_eq!(
            empty,
            Ok(StreamEvent::Chunk {
                has_text: false,
                usage: None
            })
        );
        let chat = interpret(r#"{"choices":[{"delta":{"content":"x"}}]}"#);
        assert_eq!(
            chat,
            Ok(StreamEvent::Chunk {
                has_text: true,
                usage: None
            })
        );
        let reasoning = interpret(r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#);
        assert_eq!(
            reasoning,
            Ok(StreamEvent::Chunk {
                has_text: true,
                usage: None
            })
        );
        let usage = interpret(
            r#"{"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":8,"total_tokens":24}}"#,
        );
        assert_eq!(
            usage,
            Ok(StreamEvent::Chunk {
                has_text: false,
                usage: Some(Usage {
                    prompt_tokens: Some(16),
                    completion_tokens: Some(8)
                })
            })
        );
        assert_eq!(interpret(" [DONE] "), Ok(StreamEvent::Done));
    }

    #[test]
    fn errors_and_garbage() {
        let e = interpret(r#"{"error":{"message":"boom","type":"server_error"}}"#);
        assert_eq!(e, Ok(StreamEvent::Error("boom".to_owned())));
        assert!(interpret("not json").is_err());
        assert_eq!(
            Usage::from_json(&serde_json::json!({"total_tokens": 3})),
            None
        );
        assert_eq!(Usage::from_json(&serde_json::json!(null)), None);
    }
}
