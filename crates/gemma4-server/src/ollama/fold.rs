//! One Ollama reply built from the output processor's events: a chunk per
//! piece of answer or thinking text and one per completed tool call
//! (`/api/chat`'s `message`, `/api/generate`'s `response`), then the last
//! chunk, `done: true` with the reason and the counts. The whole reply is
//! the chunks merged, so a stream always adds up to it.

use std::time::Instant;

use gemma4_text::OutputEvent;
use serde_json::{json, Map, Value};

use crate::turn::{Ending, TurnFold, TurnUsage};

/// Which route the reply answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Generate,
}

/// The reply being folded.
pub struct OllamaFold {
    route: Route,
    model: String,
    created_at: String,
    arrival: Instant,
    /// When the first output came: the end of the prompt's evaluation.
    first_output: Option<Instant>,
    content: String,
    thinking: String,
    /// Each call's name and arguments JSON text, by its position in the turn.
    calls: Vec<(String, String)>,
    /// The last chunk, once finished.
    last: Value,
}

/// A call's arguments as an object (a call cut off before they closed has none).
fn arguments(text: &str) -> Map<String, Value> {
    serde_json::from_str(text).unwrap_or_default()
}

/// Nanoseconds, as Ollama counts durations.
fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl OllamaFold {
    pub fn new(route: Route, model: String, created_at: String, arrival: Instant) -> Self {
        Self {
            route,
            model,
            created_at,
            arrival,
            first_output: None,
            content: String::new(),
            thinking: String::new(),
            calls: Vec::new(),
            last: Value::Null,
        }
    }

    /// A chunk holding `content`, `thinking` and `calls` (only those given).
    fn chunk(
        &self,
        content: &str,
        thinking: &str,
        calls: &[(String, String)],
        done: bool,
    ) -> Value {
        let mut chunk = json!({"model": self.model, "created_at": self.created_at});
        match self.route {
            Route::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !thinking.is_empty() {
                    message["thinking"] = json!(thinking);
                }
                if !calls.is_empty() {
                    let calls: Vec<Value> = calls
                        .iter()
                        .map(|(name, args)| json!({"function": {"name": name, "arguments": arguments(args)}}))
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                }
                chunk["message"] = message;
            }
            Route::Generate => {
                chunk["response"] = json!(content);
                if !thinking.is_empty() {
                    chunk["thinking"] = json!(thinking);
                }
            }
        }
        chunk["done"] = json!(done);
        chunk
    }
}

impl TurnFold for OllamaFold {
    fn start(&mut self, _usage: &TurnUsage) -> Vec<Value> {
        Vec::new()
    }

    fn apply(&mut self, e: &OutputEvent) -> Vec<Value> {
        self.first_output.get_or_insert_with(Instant::now);
        match e {
            OutputEvent::Content(text) => {
                self.content.push_str(text);
                vec![self.chunk(text, "", &[], false)]
            }
            OutputEvent::Reasoning(text) => {
                self.thinking.push_str(text);
                vec![self.chunk("", text, &[], false)]
            }
            OutputEvent::ToolCallStart { name, .. } => {
                self.calls.push((name.clone(), String::new()));
                Vec::new()
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.calls.get_mut(*index) {
                    call.1.push_str(delta);
                }
                Vec::new()
            }
            // Ollama sends each call whole, once it is complete.
            OutputEvent::ToolCallEnd { index } => match self.calls.get(*index) {
                Some(call) if self.route == Route::Chat => {
                    vec![self.chunk("", "", std::slice::from_ref(call), false)]
                }
                _ => Vec::new(),
            },
        }
    }

    fn finish(&mut self, ending: &Ending, usage: &TurnUsage) -> Vec<Value> {
        let reason = match ending {
            Ending::Failed(e) => return vec![json!({"error": e.message})],
            Ending::Incomplete => "length",
            _ => "stop",
        };
        let now = Instant::now();
        let first = self.first_output.unwrap_or(now);
        let mut last = self.chunk("", "", &[], true);
        last["done_reason"] = json!(reason);
        last["total_duration"] = json!(nanos(now - self.arrival));
        last["load_duration"] = json!(0);
        last["prompt_eval_count"] = json!(usage.input);
        last["prompt_eval_duration"] = json!(nanos(first - self.arrival));
        last["eval_count"] = json!(usage.output);
        last["eval_duration"] = json!(nanos(now - first));
        self.last = last.clone();
        vec![last]
    }

    /// The chunks merged: the whole answer, thinking and calls, with the
    /// last chunk's reason and counts.
    fn whole(&mut self) -> Value {
        let mut whole = self.chunk(&self.content, &self.thinking, &self.calls, true);
        if let (Some(w), Some(last)) = (whole.as_object_mut(), self.last.as_object()) {
            for (key, value) in last {
                if !matches!(key.as_str(), "message" | "response" | "thinking") {
                    w.insert(key.clone(), value.clone());
                }
            }
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events() -> Vec<OutputEvent> {
        vec![
            OutputEvent::Reasoning("Check the".into()),
            OutputEvent::Reasoning(" weather.".into()),
            OutputEvent::Content("Sure.".into()),
            OutputEvent::ToolCallStart {
                index: 0,
                id: "c1".into(),
                name: "get_weather".into(),
            },
            OutputEvent::ToolCallArguments {
                index: 0,
                delta: "{\"city\": \"Paris\"}".into(),
            },
            OutputEvent::ToolCallEnd { index: 0 },
        ]
    }

    #[test]
    fn the_chunks_add_up_to_the_whole_reply() {
        let mut fold = OllamaFold::new(Route::Chat, "m".into(), "t".into(), Instant::now());
        let usage = TurnUsage {
            input: 5,
            output: 8,
            ..TurnUsage::default()
        };
        let mut chunks = fold.start(&usage);
        for e in events() {
            chunks.extend(fold.apply(&e));
        }
        chunks.extend(fold.finish(&Ending::ToolCalls, &usage));
        let whole = fold.whole();
        let joined = |key: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["message"][key].as_str())
                .collect()
        };
        assert_eq!(whole["message"]["content"], joined("content"));
        assert_eq!(whole["message"]["thinking"], joined("thinking"));
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["message"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(whole["message"]["tool_calls"][0], *calls[0]);
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        let last = chunks.last().expect("chunks");
        assert_eq!(last["done"], true);
        assert_eq!(last["done_reason"], "stop");
        assert_eq!(
            (
                last["prompt_eval_count"].clone(),
                last["eval_count"].clone()
            ),
            (json!(5), json!(8))
        );
        assert!(chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["done"] == false));
        assert_eq!(whole["eval_count"], 8);
    }

    #[test]
    fn generate_replies_carry_the_response_text() {
        let mut fold = OllamaFold::new(Route::Generate, "m".into(), "t".into(), Instant::now());
        let mut chunks = Vec::new();
        for e in events() {
            chunks.extend(fold.apply(&e));
        }
        chunks.extend(fold.finish(&Ending::Incomplete, &TurnUsage::default()));
        let whole = fold.whole();
        assert_eq!(whole["response"], "Sure.");
        assert_eq!(whole["thinking"], "Check the weather.");
        assert_eq!(whole["done_reason"], "length");
        assert!(chunks.iter().all(|c| c.get("message").is_none()));
    }
}
