//! Response bodies and stream chunks in OpenAI's shapes.

use gemma4_engine::TokenLogprob;
use gemma4_text::{AssistantMessage, OutputEvent};
use serde::Serialize;
use serde_json::{Map, Value};

/// `system_fingerprint`: which server build produced a response.
pub const SYSTEM_FINGERPRINT: &str = concat!("gemma4-", env!("CARGO_PKG_VERSION"));

/// Token counts of a response.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct UsageJson {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// `usage.prompt_tokens_details` (chat, when the prompt holds media): the
/// soft tokens the images and audio clips became, in all and one by one.
/// `prompt_tokens` counts them too, with each item's begin and end tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub image_tokens: usize,
    pub audio_tokens: usize,
    /// All of a video's frames' soft tokens.
    pub video_tokens: usize,
    /// Each item in prompt order.
    pub media: Vec<MediaTokensJson>,
}

impl PromptTokensDetails {
    /// The prompt's media, item by item and summed by kind (`None` without
    /// media).
    pub fn of(media: &[MediaTokensJson]) -> Option<Self> {
        let total = |kind: &str| {
            media
                .iter()
                .filter(|m| m.kind == kind)
                .map(|m| m.soft_tokens)
                .sum()
        };
        (!media.is_empty()).then(|| Self {
            image_tokens: total("image"),
            audio_tokens: total("audio"),
            video_tokens: total("video"),
            media: media.to_vec(),
        })
    }
}

/// One image's, audio clip's or video's soft tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MediaTokensJson {
    /// `image`, `audio` or `video`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub soft_tokens: usize,
}

/// `usage.completion_tokens_details` (chat).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CompletionTokensDetails {
    /// Tokens generated inside thought channels.
    pub reasoning_tokens: usize,
}

impl UsageJson {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
            completion_tokens_details: None,
        }
    }

    /// With the prompt's media counted item by item (nothing without media).
    pub fn with_media(mut self, media: &[MediaTokensJson]) -> Self {
        self.prompt_tokens_details = PromptTokensDetails::of(media);
        self
    }

    /// Chat usage, which also counts reasoning tokens.
    pub fn with_reasoning(mut self, reasoning_tokens: usize) -> Self {
        self.completion_tokens_details = Some(CompletionTokensDetails { reasoning_tokens });
        self
    }
}

/// `chat.completion`.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageJson,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    /// `null` when the model only called tools.
    pub content: Option<String>,
    /// Always `null`: the model has no refusal channel (the API's field is
    /// required and nullable).
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallJson>,
}

impl ChatMessage {
    /// The response message of a parsed model turn.
    pub fn from_turn(turn: AssistantMessage) -> Self {
        let content = if turn.content.is_empty() && !turn.tool_calls.is_empty() {
            None
        } else {
            Some(turn.content)
        };
        Self {
            role: "assistant",
            content,
            refusal: None,
            reasoning_content: (!turn.reasoning.is_empty()).then_some(turn.reasoning),
            tool_calls: turn
                .tool_calls
                .into_iter()
                .map(|call| ToolCallJson {
                    id: call.id,
                    kind: "function",
                    function: FunctionCallJson {
                        name: call.name,
                        arguments: call.arguments,
                    },
                })
                .collect(),
        }
    }
}

/// `message.tool_calls[]`.
#[derive(Debug, Serialize)]
pub struct ToolCallJson {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallJson,
}

#[derive(Debug, Serialize)]
pub struct FunctionCallJson {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// `choices[].logprobs` of chat responses and chunks.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null`, as `message.refusal` is.
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatTokenLogprob {
    pub fn from_engine(lp: &TokenLogprob) -> Self {
        Self {
            token: lp.text.clone(),
            logprob: lp.logprob,
            bytes: lp.text.as_bytes().to_vec(),
            top_logprobs: lp
                .top
                .iter()
                .map(|(_, text, logprob)| TopLogprob {
                    token: text.clone(),
                    logprob: *logprob,
                    bytes: text.as_bytes().to_vec(),
                })
                .collect(),
        }
    }
}

/// `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageJson>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

impl Delta {
    /// The chunk delta of one protocol event: a call's first delta carries its
    /// id, type and name; later ones only argument text.
    pub fn from_event(event: OutputEvent) -> Option<Self> {
        let delta = match event {
            OutputEvent::Content(text) => Delta {
                content: Some(text),
                ..Delta::default()
            },
            OutputEvent::Reasoning(text) => Delta {
                reasoning_content: Some(text),
                ..Delta::default()
            },
            OutputEvent::ToolCallStart { index, id, name } => Delta {
                tool_calls: vec![ToolCallDelta {
                    index,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(name),
                        arguments: String::new(),
                    },
                }],
                ..Delta::default()
            },
            OutputEvent::ToolCallArguments { index, delta } => Delta {
                tool_calls: vec![ToolCallDelta {
                    index,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: delta,
                    },
                }],
                ..Delta::default()
            },
            OutputEvent::ToolCallEnd { .. } => return None,
        };
        Some(delta)
    }
}

/// `delta.tool_calls[]`.
#[derive(Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `text_completion`, both as a whole response and as a stream chunk.
#[derive(Debug, Serialize)]
pub struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: &'static str,
    pub choices: Vec<TextChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageJson>,
}

#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `prompt_logprobs`: per prompt token, `null` for the first, then
    /// `{id: {logprob, rank, decoded_token}}` for the token and its alternatives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<Map<String, Value>>>>,
}

/// The legacy completions log-probability layout. With `echo`, the prompt's
/// first token has no log-probability (`null`).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends one token whose text starts at `offset` in the choice's text.
    pub fn push(&mut self, lp: &TokenLogprob, offset: usize) {
        self.tokens.push(lp.text.clone());
        self.token_logprobs.push(Some(lp.logprob));
        let mut top = Map::new();
        for (_, text, logprob) in &lp.top {
            top.entry(text.clone())
                .or_insert_with(|| logprob_json(*logprob));
        }
        self.top_logprobs.push(Some(top));
        self.text_offset.push(offset);
    }

    /// Appends a token that has no log-probability (a prompt's first).
    pub fn push_unscored(&mut self, text: &str) {
        self.tokens.push(text.to_owned());
        self.token_logprobs.push(None);
        self.top_logprobs.push(None);
        self.text_offset.push(0);
    }
}

/// A log-probability as JSON, written as an `f32` field serializes (its
/// shortest decimal), so every place a value appears shows the same digits.
pub fn logprob_json(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

/// vLLM's `prompt_logprobs` entry of one scored prompt token: the token and
/// its alternatives by id.
pub fn prompt_logprob_entry(lp: &TokenLogprob) -> Map<String, Value> {
    let mut entry = Map::new();
    entry.insert(
        lp.token_id.to_string(),
        serde_json::json!({"logprob": logprob_json(lp.logprob), "rank": lp.rank, "decoded_token": lp.text}),
    );
    for (rank, (id, text, logprob)) in lp.top.iter().enumerate() {
        entry.entry(id.to_string()).or_insert_with(
            || serde_json::json!({"logprob": logprob_json(*logprob), "rank": rank + 1, "decoded_token": text}),
        );
    }
    entry
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The base model, for a LoRA adapter (`null` for the model itself).
    pub parent: Option<String>,
    pub max_model_len: usize,
}

/// `POST /generate`.
#[derive(Debug, Serialize)]
pub struct GenerateResponse {
    pub response: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: &'static str,
    pub usage: UsageJson,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_serializes_null_finish_reason_and_skips_absent_delta_fields() {
        let chunk = ChatChunk {
            id: "chatcmpl-1",
            object: "chat.completion.chunk",
            created: 1,
            model: "m",
            system_fingerprint: "fp",
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta {
                    content: Some("hi".into()),
                    ..Delta::default()
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        let v = serde_json::to_value(&chunk).expect("serializable");
        assert!(v["choices"][0]["finish_reason"].is_null());
        assert!(v["choices"][0]["delta"].get("role").is_none());
        assert_eq!(v["choices"][0]["delta"]["content"], "hi");
        assert!(v.get("usage").is_none());
    }

    #[test]
    fn turns_become_openai_messages_and_deltas() {
        let turn = AssistantMessage {
            content: String::new(),
            reasoning: "hmm".into(),
            tool_calls: vec![gemma4_text::ToolCall {
                id: "call_0".into(),
                name: "f".into(),
                arguments: r#"{"a": 1}"#.into(),
                complete: true,
            }],
        };
        let v = serde_json::to_value(ChatMessage::from_turn(turn)).expect("serializable");
        assert!(v["content"].is_null());
        assert_eq!(v["reasoning_content"], "hmm");
        assert_eq!(v["tool_calls"][0]["type"], "function");
        assert_eq!(v["tool_calls"][0]["function"]["arguments"], r#"{"a": 1}"#);
        let plain = serde_json::to_value(ChatMessage::from_turn(AssistantMessage::default()))
            .expect("serializable");
        assert_eq!(plain["content"], "");
        assert!(plain.get("tool_calls").is_none() && plain.get("reasoning_content").is_none());

        let start = Delta::from_event(OutputEvent::ToolCallStart {
            index: 1,
            id: "call_1".into(),
            name: "g".into(),
        });
        let v = serde_json::to_value(start).expect("serializable");
        assert_eq!(v["tool_calls"][0]["index"], 1);
        assert_eq!(v["tool_calls"][0]["id"], "call_1");
        assert_eq!(v["tool_calls"][0]["function"]["name"], "g");
        let args = Delta::from_event(OutputEvent::ToolCallArguments {
            index: 1,
            delta: "{".into(),
        });
        let v = serde_json::to_value(args).expect("serializable");
        assert!(v["tool_calls"][0].get("id").is_none());
        assert_eq!(v["tool_calls"][0]["function"]["arguments"], "{");
        assert!(Delta::from_event(OutputEvent::ToolCallEnd { index: 1 }).is_none());
    }

    #[test]
    fn completion_logprobs_layout() {
        let lp = TokenLogprob {
            token_id: 7,
            text: "a".into(),
            logprob: -0.5,
            rank: 1,
            top: vec![(7, "a".into(), -0.5), (8, "b".into(), -1.5)],
        };
        let mut l = CompletionLogprobs::default();
        l.push(&lp, 3);
        let v = serde_json::to_value(&l).expect("serializable");
        assert_eq!(v["tokens"][0], "a");
        assert_eq!(v["text_offset"][0], 3);
        assert_eq!(v["top_logprobs"][0]["b"], -1.5);
        // A value with no short f64 spelling reads the same in both places.
        let x = -5.420_781_f32;
        let lp = TokenLogprob {
            logprob: x,
            top: vec![(7, "a".into(), x)],
            ..lp
        };
        let mut l = CompletionLogprobs::default();
        l.push(&lp, 0);
        // As the wire carries it (an `f32` field is written by its own digits).
        let wire = serde_json::to_string(&l).expect("serializable");
        let v: Value = serde_json::from_str(&wire).expect("json");
        assert_eq!(v["token_logprobs"][0], v["top_logprobs"][0]["a"]);
        assert_eq!(v["token_logprobs"][0].to_string(), "-5.420781");
    }
}
