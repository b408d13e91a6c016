//! Response bodies and stream chunks in OpenAI's shapes.

use gemma4_engine::TokenLogprob;
use serde::Serialize;
use serde_json::{Map, Value};

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UsageJson {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl UsageJson {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// `chat.completion`.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
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
    pub content: String,
}

/// `choices[].logprobs` of chat responses and chunks.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
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
}

/// `text_completion`, both as a whole response and as a stream chunk.
#[derive(Debug, Serialize)]
pub struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
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
}

/// The legacy completions log-probability layout.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends one token whose text starts at `offset` in the choice's text.
    pub fn push(&mut self, lp: &TokenLogprob, offset: usize) {
        self.tokens.push(lp.text.clone());
        self.token_logprobs.push(lp.logprob);
        let mut top = Map::new();
        for (_, text, logprob) in &lp.top {
            top.entry(text.clone())
                .or_insert_with(|| serde_json::json!(logprob));
        }
        self.top_logprobs.push(top);
        self.text_offset.push(offset);
    }
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
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: None,
                    content: Some("hi".into()),
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
    fn completion_logprobs_layout() {
        let lp = TokenLogprob {
            token_id: 7,
            text: "a".into(),
            logprob: -0.5,
            top: vec![(7, "a".into(), -0.5), (8, "b".into(), -1.5)],
        };
        let mut l = CompletionLogprobs::default();
        l.push(&lp, 3);
        let v = serde_json::to_value(&l).expect("serializable");
        assert_eq!(v["tokens"][0], "a");
        assert_eq!(v["text_offset"][0], 3);
        assert_eq!(v["top_logprobs"][0]["b"], -1.5);
    }
}
