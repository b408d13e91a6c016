//! One Responses turn built from the output processor's events: the output
//! items (`reasoning`, `message`, `function_call`) and, for streams, the
//! events that announce them. The whole and the streamed reply both come
//! from this one assembler, so a stream always adds up to the whole response.

use gemma4_text::OutputEvent;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::response::SYSTEM_FINGERPRINT;
use crate::turn::{Ending, TurnFold, TurnUsage};

#[derive(Debug)]
enum Kind {
    Reasoning,
    Message,
    FunctionCall { call_id: String, name: String },
}

#[derive(Debug)]
struct Item {
    kind: Kind,
    id: String,
    /// Reasoning text, answer text, or a call's arguments.
    text: String,
    /// Closed: its `done` events are sent.
    done: bool,
    /// A call whose arguments were not finished, or an item cut by the token limit.
    incomplete: bool,
}

impl Item {
    fn status(&self) -> &'static str {
        match (self.done, self.incomplete) {
            (false, _) => "in_progress",
            (true, false) => "completed",
            (true, true) => "incomplete",
        }
    }

    fn part(&self) -> Value {
        match self.kind {
            Kind::Reasoning => json!({"type": "reasoning_text", "text": self.text}),
            _ => {
                json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
            }
        }
    }

    fn json(&self) -> Value {
        match &self.kind {
            Kind::Reasoning => json!({
                "type": "reasoning", "id": self.id, "summary": [],
                "content": [self.part()], "status": self.status(),
            }),
            Kind::Message => json!({
                "type": "message", "id": self.id, "role": "assistant",
                "status": self.status(), "content": [self.part()],
            }),
            Kind::FunctionCall { call_id, name } => json!({
                "type": "function_call", "id": self.id, "call_id": call_id, "name": name,
                "arguments": self.text, "status": self.status(),
            }),
        }
    }

    /// The item as `output_item.added` shows it: nothing in it yet.
    fn opened_json(&self) -> Value {
        let mut v = self.json();
        match self.kind {
            Kind::FunctionCall { .. } => v["arguments"] = json!(""),
            _ => v["content"] = json!([]),
        }
        v
    }
}

/// The turn being assembled.
pub struct Assembler {
    id: String,
    model: String,
    created_at: u64,
    /// The request's settings every Response object repeats (`instructions`,
    /// `tools`, `tool_choice`, `temperature`, …).
    settings: Value,
    items: Vec<Item>,
    /// White space between items, held until text follows it.
    held: String,
    /// Item index of each tool call, by the call's position in the turn.
    calls: Vec<usize>,
    sequence: u64,
    /// The response object as the last event showed it.
    last: Value,
}

impl Assembler {
    pub fn new(id: String, model: String, created_at: u64, settings: Value) -> Self {
        Self {
            id,
            model,
            created_at,
            settings,
            items: Vec::new(),
            held: String::new(),
            calls: Vec::new(),
            sequence: 0,
            last: Value::Null,
        }
    }

    fn event(&mut self, kind: &str, mut fields: Value) -> Value {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        fields
    }

    /// The opening events: the response exists and is in progress.
    fn opening(&mut self) -> Vec<Value> {
        let snapshot = self.response("in_progress", None, &TurnUsage::default());
        vec![
            self.event("response.created", json!({"response": snapshot.clone()})),
            self.event("response.in_progress", json!({"response": snapshot})),
        ]
    }

    /// The events that one output event causes.
    fn event_of(&mut self, e: &OutputEvent) -> Vec<Value> {
        let mut out = Vec::new();
        match e {
            OutputEvent::Reasoning(text) => self.text(Kind::Reasoning, text, &mut out),
            OutputEvent::Content(text) => {
                let open_message = matches!(
                    self.items.last(),
                    Some(Item {
                        kind: Kind::Message,
                        done: false,
                        ..
                    })
                );
                if !open_message && text.trim().is_empty() {
                    self.held.push_str(text);
                } else {
                    let text = std::mem::take(&mut self.held) + text;
                    self.text(Kind::Message, &text, &mut out);
                }
            }
            OutputEvent::ToolCallStart { id, name, .. } => {
                self.held.clear();
                self.close_open(false, &mut out);
                let index = self.open(
                    Kind::FunctionCall {
                        call_id: id.clone(),
                        name: name.clone(),
                    },
                    format!("fc_{id}"),
                    &mut out,
                );
                self.calls.push(index);
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(&item) = self.calls.get(*index) {
                    self.items[item].text.push_str(delta);
                    let id = self.items[item].id.clone();
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": item, "delta": delta}),
                    ));
                }
            }
            OutputEvent::ToolCallEnd { index } => {
                if let Some(&item) = self.calls.get(*index) {
                    self.close(item, false, &mut out);
                }
            }
        }
        out
    }

    /// Text for a reasoning or message item: the open one of that kind, or a new one.
    fn text(&mut self, kind: Kind, text: &str, out: &mut Vec<Value>) {
        let same = |item: &Item| {
            !item.done
                && matches!(
                    (&item.kind, &kind),
                    (Kind::Reasoning, Kind::Reasoning) | (Kind::Message, Kind::Message)
                )
        };
        let index = match self.items.last() {
            Some(item) if same(item) => self.items.len() - 1,
            _ => {
                self.close_open(false, out);
                let prefix = match kind {
                    Kind::Reasoning => "rs",
                    _ => "msg",
                };
                let id = format!("{prefix}_{}_{}", self.id, self.items.len());
                self.open(kind, id, out)
            }
        };
        self.items[index].text.push_str(text);
        let (id, kind) = (self.items[index].id.clone(), &self.items[index].kind);
        let name = match kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            _ => "response.output_text.delta",
        };
        let mut fields =
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text});
        if name == "response.output_text.delta" {
            fields["logprobs"] = json!([]);
        }
        out.push(self.event(name, fields));
    }

    fn open(&mut self, kind: Kind, id: String, out: &mut Vec<Value>) -> usize {
        let item = Item {
            kind,
            id,
            text: String::new(),
            done: false,
            incomplete: false,
        };
        let index = self.items.len();
        let (added, part) = (item.opened_json(), item.part());
        let item_id = item.id.clone();
        let has_part = !matches!(item.kind, Kind::FunctionCall { .. });
        self.items.push(item);
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        if has_part {
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
            ));
        }
        index
    }

    /// Closes the open reasoning or message item, if any.
    fn close_open(&mut self, incomplete: bool, out: &mut Vec<Value>) {
        if let Some(index) = self.items.iter().rposition(|i| !i.done) {
            self.close(index, incomplete, out);
        }
    }

    fn close(&mut self, index: usize, incomplete: bool, out: &mut Vec<Value>) {
        let item = &mut self.items[index];
        if item.done {
            return;
        }
        item.done = true;
        item.incomplete = incomplete;
        let (id, text, part, whole) =
            (item.id.clone(), item.text.clone(), item.part(), item.json());
        let at = json!({"item_id": id, "output_index": index});
        let with = |mut v: Value, key: &str, value: Value| {
            v[key] = value;
            v
        };
        match &item.kind {
            Kind::FunctionCall { name, .. } => {
                let fields = with(with(at, "arguments", json!(text)), "name", json!(name));
                out.push(self.event("response.function_call_arguments.done", fields));
            }
            kind => {
                let (name, mut fields) = match kind {
                    Kind::Reasoning => ("response.reasoning_text.done", at.clone()),
                    _ => (
                        "response.output_text.done",
                        with(at.clone(), "logprobs", json!([])),
                    ),
                };
                fields["content_index"] = json!(0);
                fields["text"] = json!(text);
                out.push(self.event(name, fields));
                let part_done = with(with(at, "content_index", json!(0)), "part", part);
                out.push(self.event("response.content_part.done", part_done));
            }
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": whole}),
        ));
    }

    /// Closes every item and returns the last events: `response.completed`,
    /// `response.incomplete` or `response.failed`, each with the whole response.
    fn closing(&mut self, ending: &Ending, usage: &TurnUsage) -> Vec<Value> {
        let mut out = Vec::new();
        let cut = matches!(ending, Ending::Incomplete);
        let has_answer = self
            .items
            .iter()
            .any(|i| !matches!(i.kind, Kind::Reasoning));
        if !has_answer && !matches!(ending, Ending::Failed(_)) {
            // A turn always answers, even with nothing: one message item.
            let text = std::mem::take(&mut self.held);
            self.text(Kind::Message, &text, &mut out);
        }
        for index in 0..self.items.len() {
            // A call whose arguments never closed is incomplete however the turn ended.
            let unfinished_call = matches!(self.items[index].kind, Kind::FunctionCall { .. });
            self.close(index, cut || unfinished_call, &mut out);
        }
        let (name, response) = match ending {
            Ending::Completed | Ending::ToolCalls | Ending::StopString(_) => (
                "response.completed",
                self.response("completed", None, usage),
            ),
            Ending::Incomplete => (
                "response.incomplete",
                self.response("incomplete", None, usage),
            ),
            Ending::Failed(e) => ("response.failed", self.response("failed", Some(e), usage)),
        };
        self.last = response.clone();
        out.push(self.event(name, json!({ "response": response })));
        out
    }

    /// The response object with the items so far.
    pub fn response(&self, status: &str, error: Option<&ApiError>, usage: &TurnUsage) -> Value {
        let mut usage_json = json!({
            "input_tokens": usage.input,
            "output_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning},
        });
        let mut details = json!({
            "cached_tokens": usage.cached,
            "cache_write_tokens": usage.cache_written,
        });
        if let (Some(media), Some(d)) = (&usage.media, details.as_object_mut()) {
            // Each image's, clip's and video's soft tokens, as chat's
            // `prompt_tokens_details` has them.
            if let Value::Object(media) = json!(media) {
                d.extend(media);
            }
        }
        usage_json["input_tokens_details"] = details;
        let mut response = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": error.map(|e| json!({"code": e.code.unwrap_or(e.kind), "message": e.message})),
            "incomplete_details": if status == "incomplete" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            "output": self.items.iter().map(Item::json).collect::<Vec<_>>(),
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage_json,
        });
        if let (Some(r), Value::Object(settings)) = (response.as_object_mut(), &self.settings) {
            r.extend(settings.clone());
        }
        response
    }
}

impl TurnFold for Assembler {
    fn start(&mut self, _usage: &TurnUsage) -> Vec<Value> {
        self.opening()
    }

    fn apply(&mut self, e: &OutputEvent) -> Vec<Value> {
        self.event_of(e)
    }

    fn finish(&mut self, ending: &Ending, usage: &TurnUsage) -> Vec<Value> {
        self.closing(ending, usage)
    }

    fn whole(&mut self) -> Value {
        self.last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(a: &mut Assembler, input: &[OutputEvent], ending: Ending) -> Vec<Value> {
        let mut out = a.start(&TurnUsage::default());
        for e in input {
            out.extend(a.apply(e));
        }
        out.extend(a.finish(&ending, &TurnUsage::default()));
        out
    }

    /// What a client builds from the stream: items from `added`, text from deltas.
    fn replay(events: &[Value]) -> Vec<Value> {
        let mut items: Vec<Value> = Vec::new();
        for e in events {
            let at = e["output_index"].as_u64().unwrap_or(0) as usize;
            match e["type"].as_str().unwrap_or_default() {
                "response.output_item.added" => {
                    assert_eq!(at, items.len(), "items are added in order");
                    items.push(e["item"].clone());
                }
                "response.content_part.added" => {
                    items[at]["content"] = json!([e["part"].clone()]);
                }
                "response.output_text.delta" | "response.reasoning_text.delta" => {
                    let text = items[at]["content"][0]["text"].as_str().unwrap_or_default();
                    let joined = format!("{text}{}", e["delta"].as_str().unwrap_or_default());
                    items[at]["content"][0]["text"] = json!(joined);
                }
                "response.function_call_arguments.delta" => {
                    let args = items[at]["arguments"].as_str().unwrap_or_default();
                    let joined = format!("{args}{}", e["delta"].as_str().unwrap_or_default());
                    items[at]["arguments"] = json!(joined);
                }
                "response.output_item.done" => {
                    let mut finished = items[at].clone();
                    finished["status"] = e["item"]["status"].clone();
                    assert_eq!(
                        finished, e["item"],
                        "the deltas add up to the finished item"
                    );
                    items[at] = finished;
                }
                _ => {}
            }
        }
        items
    }

    fn turn() -> Vec<OutputEvent> {
        vec![
            OutputEvent::Reasoning("Let me ".into()),
            OutputEvent::Reasoning("think.".into()),
            OutputEvent::Content("\n".into()),
            OutputEvent::ToolCallStart {
                index: 0,
                id: "call_1".into(),
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
            OutputEvent::Content(" ".into()),
        ]
    }

    #[test]
    fn a_stream_adds_up_to_the_whole_response() {
        let mut a = Assembler::new("resp-1".into(), "m".into(), 0, json!({}));
        let all = events(&mut a, &turn(), Ending::Completed);
        let last = all.last().expect("events");
        assert_eq!(last["type"], "response.completed");
        let output = last["response"]["output"]
            .as_array()
            .expect("output")
            .clone();
        assert_eq!(replay(&all), output);
        let kinds: Vec<&str> = output.iter().filter_map(|i| i["type"].as_str()).collect();
        // White space around the call makes no message item of its own.
        assert_eq!(kinds, ["reasoning", "function_call"]);
        assert_eq!(output[0]["content"][0]["text"], "Let me think.");
        assert_eq!(output[1]["arguments"], "{\"city\": \"Paris\"}");
        assert_eq!(output[1]["call_id"], "call_1");
        assert_eq!(output[1]["status"], "completed");
        let numbers: Vec<u64> = all
            .iter()
            .filter_map(|e| e["sequence_number"].as_u64())
            .collect();
        assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
        assert_eq!(all[0]["type"], "response.created");
        assert_eq!(all[0]["response"]["status"], "in_progress");
    }

    #[test]
    fn a_cut_turn_is_incomplete_and_an_empty_one_still_answers() {
        let mut a = Assembler::new("resp-2".into(), "m".into(), 0, json!({}));
        let cut = &turn()[..5];
        let all = events(&mut a, cut, Ending::Incomplete);
        let last = all.last().expect("events");
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(
            last["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(last["response"]["output"][1]["status"], "incomplete");
        assert_eq!(
            replay(&all),
            *last["response"]["output"].as_array().expect("output")
        );

        let mut a = Assembler::new("resp-3".into(), "m".into(), 0, json!({}));
        let all = events(
            &mut a,
            &[OutputEvent::Content("  ".into())],
            Ending::Completed,
        );
        let output = &all.last().expect("events")["response"]["output"];
        assert_eq!(output.as_array().map(Vec::len), Some(1));
        assert_eq!(output[0]["type"], "message");
        assert_eq!(output[0]["content"][0]["text"], "  ");

        let mut a = Assembler::new("resp-4".into(), "m".into(), 0, json!({}));
        let text = [
            OutputEvent::Content("Hello".into()),
            OutputEvent::Content(", world".into()),
        ];
        let all = events(&mut a, &text, Ending::Completed);
        let output = &all.last().expect("events")["response"]["output"];
        assert_eq!(output[0]["content"][0]["text"], "Hello, world");
        assert_eq!(output[0]["status"], "completed");
    }

    #[test]
    fn a_failure_names_its_error() {
        let mut a = Assembler::new("resp-5".into(), "m".into(), 0, json!({}));
        let failed = Ending::Failed(ApiError::internal("generation failed: boom"));
        let all = events(&mut a, &[OutputEvent::Content("Hi".into())], failed);
        let last = all.last().expect("events");
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["status"], "failed");
        assert!(last["response"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("boom")));
    }
}
