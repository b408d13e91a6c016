//! One Messages reply built from the output processor's events: content
//! blocks (`thinking`, `text`, one `tool_use` per call) and, for streams,
//! Anthropic's events announcing them (`message_start`,
//! `content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`).
//! The whole reply is this fold's final message, so a stream always adds up
//! to it.

use gemma4_text::OutputEvent;
use serde_json::{json, Map, Value};

use super::error_body;
use crate::turn::{Ending, TurnFold, TurnUsage};

#[derive(Debug)]
enum Kind {
    Thinking,
    Text,
    ToolUse { id: String, name: String },
}

#[derive(Debug)]
struct Block {
    kind: Kind,
    /// Thinking text, answer text, or a call's input as JSON text.
    text: String,
    done: bool,
}

impl Block {
    fn json(&self) -> Value {
        match &self.kind {
            // Gemma's thinking carries no signature; the field is required.
            Kind::Thinking => json!({"type": "thinking", "thinking": self.text, "signature": ""}),
            Kind::Text => json!({"type": "text", "text": self.text}),
            Kind::ToolUse { id, name } => {
                // A call cut off before its input closed has no input to show.
                let input =
                    serde_json::from_str::<Map<String, Value>>(&self.text).unwrap_or_default();
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    /// The block as `content_block_start` shows it: nothing in it yet.
    fn opened_json(&self) -> Value {
        match &self.kind {
            Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Kind::Text => json!({"type": "text", "text": ""}),
            Kind::ToolUse { id, name } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": {}})
            }
        }
    }

    fn delta(&self, text: &str) -> Value {
        match self.kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Kind::Text => json!({"type": "text_delta", "text": text}),
            Kind::ToolUse { .. } => json!({"type": "input_json_delta", "partial_json": text}),
        }
    }
}

/// The reply being folded.
pub struct MessageFold {
    id: String,
    model: String,
    blocks: Vec<Block>,
    /// White space between blocks, held until text follows it.
    held: String,
    /// Block index of each tool call, by the call's position in the turn.
    calls: Vec<usize>,
    /// The whole message, once finished.
    message: Value,
}

fn usage_json(usage: &TurnUsage) -> Value {
    json!({
        "input_tokens": usage.input,
        "output_tokens": usage.output,
        "cache_read_input_tokens": usage.cached,
        "cache_creation_input_tokens": usage.cache_written,
    })
}

impl MessageFold {
    pub fn new(id: String, model: String) -> Self {
        Self {
            id,
            model,
            blocks: Vec::new(),
            held: String::new(),
            calls: Vec::new(),
            message: Value::Null,
        }
    }

    fn message(&self, stop_reason: Option<&str>, usage: &TurnUsage) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks.iter().map(Block::json).collect::<Vec<_>>(),
            "stop_reason": stop_reason,
            "stop_sequence": null,
            "usage": usage_json(usage),
        })
    }

    /// Text for a thinking or text block: the open one of that kind, or a new one.
    fn text(&mut self, thinking: bool, text: &str, out: &mut Vec<Value>) {
        let open = self.blocks.last().filter(|b| !b.done).is_some_and(|b| {
            matches!(
                (&b.kind, thinking),
                (Kind::Thinking, true) | (Kind::Text, false)
            )
        });
        let index = if open {
            self.blocks.len() - 1
        } else {
            self.close_open(out);
            let kind = if thinking { Kind::Thinking } else { Kind::Text };
            self.open(kind, out)
        };
        self.blocks[index].text.push_str(text);
        let delta = self.blocks[index].delta(text);
        out.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
    }

    fn open(&mut self, kind: Kind, out: &mut Vec<Value>) -> usize {
        let block = Block {
            kind,
            text: String::new(),
            done: false,
        };
        let index = self.blocks.len();
        out.push(json!({"type": "content_block_start", "index": index, "content_block": block.opened_json()}));
        self.blocks.push(block);
        index
    }

    fn close_open(&mut self, out: &mut Vec<Value>) {
        if let Some(index) = self.blocks.iter().rposition(|b| !b.done) {
            self.close(index, out);
        }
    }

    fn close(&mut self, index: usize, out: &mut Vec<Value>) {
        let block = &mut self.blocks[index];
        if block.done {
            return;
        }
        block.done = true;
        if matches!(block.kind, Kind::Thinking) {
            let delta = json!({"type": "signature_delta", "signature": ""});
            out.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
        }
        out.push(json!({"type": "content_block_stop", "index": index}));
    }
}

impl TurnFold for MessageFold {
    fn start(&mut self, usage: &TurnUsage) -> Vec<Value> {
        let opening = TurnUsage {
            output: 0,
            ..usage.clone()
        };
        vec![
            json!({"type": "message_start", "message": self.message(None, &opening)}),
            json!({"type": "ping"}),
        ]
    }

    fn apply(&mut self, e: &OutputEvent) -> Vec<Value> {
        let mut out = Vec::new();
        match e {
            OutputEvent::Reasoning(text) => self.text(true, text, &mut out),
            OutputEvent::Content(text) => {
                let open_text = self
                    .blocks
                    .last()
                    .is_some_and(|b| !b.done && matches!(b.kind, Kind::Text));
                if !open_text && text.trim().is_empty() {
                    self.held.push_str(text);
                } else {
                    let text = std::mem::take(&mut self.held) + text;
                    self.text(false, &text, &mut out);
                }
            }
            OutputEvent::ToolCallStart { id, name, .. } => {
                self.held.clear();
                self.close_open(&mut out);
                let kind = Kind::ToolUse {
                    id: id.clone(),
                    name: name.clone(),
                };
                let index = self.open(kind, &mut out);
                self.calls.push(index);
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(&block) = self.calls.get(*index) {
                    self.blocks[block].text.push_str(delta);
                    let delta = self.blocks[block].delta(delta);
                    out.push(
                        json!({"type": "content_block_delta", "index": block, "delta": delta}),
                    );
                }
            }
            OutputEvent::ToolCallEnd { index } => {
                if let Some(&block) = self.calls.get(*index) {
                    self.close(block, &mut out);
                }
            }
        }
        out
    }

    fn finish(&mut self, ending: &Ending, usage: &TurnUsage) -> Vec<Value> {
        let mut out = Vec::new();
        for index in 0..self.blocks.len() {
            self.close(index, &mut out);
        }
        let (stop_reason, stop_sequence) = match ending {
            Ending::Failed(e) => {
                out.push(error_body(e));
                return out;
            }
            Ending::Completed => ("end_turn", None),
            Ending::ToolCalls => ("tool_use", None),
            Ending::StopString(s) => ("stop_sequence", Some(s.as_str())),
            Ending::Incomplete => ("max_tokens", None),
        };
        self.message = self.message(Some(stop_reason), usage);
        self.message["stop_sequence"] = json!(stop_sequence);
        out.push(json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage_json(usage),
        }));
        out.push(json!({"type": "message_stop"}));
        out
    }

    fn whole(&mut self) -> Value {
        self.message.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a client builds from the stream: blocks from starts, text from deltas.
    fn replay(events: &[Value]) -> Value {
        let mut message = Value::Null;
        let mut inputs: Vec<String> = Vec::new();
        for e in events {
            let at = e["index"].as_u64().unwrap_or(0) as usize;
            match e["type"].as_str().unwrap_or_default() {
                "message_start" => message = e["message"].clone(),
                "content_block_start" => {
                    assert_eq!(Some(at), message["content"].as_array().map(Vec::len));
                    message["content"]
                        .as_array_mut()
                        .expect("content")
                        .push(e["content_block"].clone());
                    inputs.push(String::new());
                }
                "content_block_delta" => {
                    let block = &mut message["content"][at];
                    let d = &e["delta"];
                    let (field, piece) = match d["type"].as_str().unwrap_or_default() {
                        "text_delta" => ("text", &d["text"]),
                        "thinking_delta" => ("thinking", &d["thinking"]),
                        "signature_delta" => ("signature", &d["signature"]),
                        _ => {
                            inputs[at].push_str(d["partial_json"].as_str().unwrap_or_default());
                            continue;
                        }
                    };
                    let joined = format!(
                        "{}{}",
                        block[field].as_str().unwrap_or_default(),
                        piece.as_str().unwrap_or_default()
                    );
                    block[field] = json!(joined);
                }
                "content_block_stop" if message["content"][at]["type"] == "tool_use" => {
                    message["content"][at]["input"] =
                        serde_json::from_str(&inputs[at]).unwrap_or(json!({}));
                }
                "message_delta" => {
                    message["stop_reason"] = e["delta"]["stop_reason"].clone();
                    message["usage"] = e["usage"].clone();
                }
                _ => {}
            }
        }
        message
    }

    #[test]
    fn the_stream_adds_up_to_the_whole_message() {
        let mut fold = MessageFold::new("msg_1".into(), "m".into());
        let usage = TurnUsage {
            input: 7,
            output: 9,
            ..TurnUsage::default()
        };
        let mut events = fold.start(&usage);
        for e in [
            OutputEvent::Reasoning("Weather".into()),
            OutputEvent::Reasoning(" first.".into()),
            OutputEvent::Content("\n".into()),
            OutputEvent::Content("Let me check.".into()),
            OutputEvent::ToolCallStart {
                index: 0,
                id: "c1".into(),
                name: "get_weather".into(),
            },
            OutputEvent::ToolCallArguments {
                index: 0,
                delta: "{\"city\": ".into(),
            },
            OutputEvent::ToolCallArguments {
                index: 0,
                delta: "\"Paris\"}".into(),
            },
            OutputEvent::ToolCallEnd { index: 0 },
        ] {
            events.extend(fold.apply(&e));
        }
        events.extend(fold.finish(&Ending::ToolCalls, &usage));
        let whole = fold.whole();
        assert_eq!(replay(&events), whole);
        assert_eq!(whole["stop_reason"], "tool_use");
        assert_eq!(whole["content"][0]["thinking"], "Weather first.");
        assert_eq!(whole["content"][1]["text"], "\nLet me check.");
        assert_eq!(whole["content"][2]["input"], json!({"city": "Paris"}));
        assert_eq!(whole["usage"]["output_tokens"], 9);
        assert_eq!(events[0]["message"]["usage"]["output_tokens"], 0);
        assert_eq!(events.last().expect("events")["type"], "message_stop");
    }

    #[test]
    fn a_failed_turn_ends_with_an_error_event() {
        let mut fold = MessageFold::new("msg_2".into(), "m".into());
        let mut events = fold.start(&TurnUsage::default());
        events.extend(fold.apply(&OutputEvent::Content("Hi".into())));
        let e = crate::error::ApiError::timeout("the request ran past its deadline");
        events.extend(fold.finish(&Ending::Failed(e), &TurnUsage::default()));
        let last = events.last().expect("events");
        assert_eq!(last["type"], "error");
        assert_eq!(last["error"]["type"], "timeout_error");
        assert!(events.iter().any(|e| e["type"] == "content_block_stop"));
    }
}
