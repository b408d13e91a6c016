//! Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
//! A request that ends abnormally (timeout, engine error) sends an
//! `{"error": …}` event before `[DONE]`. The stream owns the engine streams:
//! a client that disconnects drops it, which cancels the requests.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use gemma4_engine::{EngineEvent, TokenLogprob};
use gemma4_text::OutputEvent;
use serde::Serialize;

use crate::drain::ActiveGuard;
use crate::generation::{finish_error, ChoiceEvent, Generation};
use crate::openai::response::{
    ChatChunk, ChatChunkChoice, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, Delta,
    TextChoice, TextCompletion, UsageJson, SYSTEM_FINGERPRINT,
};
use crate::server::AppState;

/// Which chunk layout to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Chat,
    Completion,
}

/// What every chunk repeats.
pub struct StreamMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub format: Format,
    pub logprobs: bool,
    pub include_usage: bool,
}

struct Streamer {
    generation: Generation,
    meta: StreamMeta,
    state: Arc<AppState>,
    pending: VecDeque<Event>,
    /// Characters sent so far per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    completion_tokens: usize,
    finished: bool,
    _guard: ActiveGuard,
}

fn data(value: &impl Serialize) -> Event {
    let text = serde_json::to_string(value).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"message":"cannot encode a chunk: {e}","type":"server_error"}}}}"#)
    });
    Event::default().data(text)
}

impl Streamer {
    fn chat_chunk(&self, choice: ChatChunkChoice) -> Event {
        data(&ChatChunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices: vec![choice],
            usage: None,
        })
    }

    fn text_chunk(&self, choice: TextChoice) -> Event {
        data(&TextCompletion {
            id: &self.meta.id,
            object: "text_completion",
            created: self.meta.created,
            model: &self.meta.model,
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices: vec![choice],
            usage: None,
        })
    }

    /// The opening chunks: chat announces the assistant role for each choice.
    fn start(&mut self) {
        if self.meta.format == Format::Chat {
            for index in 0..self.generation.choices {
                let e = self.chat_chunk(ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                        ..Delta::default()
                    },
                    logprobs: None,
                    finish_reason: None,
                });
                self.pending.push_back(e);
            }
        }
    }

    /// A token's chunks: chat sends one per protocol event (the token's
    /// log-probability rides on the first), completions the token's text.
    fn token(
        &mut self,
        index: usize,
        text: String,
        parsed: Vec<OutputEvent>,
        logprob: Option<TokenLogprob>,
    ) {
        let mut logprob = logprob.filter(|_| self.meta.logprobs);
        match self.meta.format {
            Format::Chat => {
                let mut deltas: Vec<Delta> =
                    parsed.into_iter().filter_map(Delta::from_event).collect();
                if deltas.is_empty() && logprob.is_some() {
                    deltas.push(Delta::default());
                }
                for delta in deltas {
                    let e = self.chat_chunk(ChatChunkChoice {
                        index,
                        delta,
                        logprobs: logprob.take().map(|lp| ChatLogprobs {
                            content: vec![ChatTokenLogprob::from_engine(&lp)],
                            refusal: None,
                        }),
                        finish_reason: None,
                    });
                    self.pending.push_back(e);
                }
            }
            Format::Completion => {
                if text.is_empty() && logprob.is_none() {
                    return;
                }
                let offset = self.offsets.get(index).copied().unwrap_or(0);
                if let Some(o) = self.offsets.get_mut(index) {
                    *o += text.chars().count();
                }
                let e = self.text_chunk(TextChoice {
                    index,
                    text,
                    logprobs: logprob.map(|lp| {
                        let mut l = CompletionLogprobs::default();
                        l.push(&lp, offset);
                        l
                    }),
                    finish_reason: None,
                });
                self.pending.push_back(e);
            }
        }
    }

    /// The last text or events of a choice, then its finish reason.
    fn finish(
        &mut self,
        index: usize,
        text: String,
        parsed: Vec<OutputEvent>,
        reason: &'static str,
    ) {
        match self.meta.format {
            Format::Chat => {
                self.token(index, String::new(), parsed, None);
                let e = self.chat_chunk(ChatChunkChoice {
                    index,
                    delta: Delta::default(),
                    logprobs: None,
                    finish_reason: Some(reason),
                });
                self.pending.push_back(e);
            }
            Format::Completion => {
                let e = self.text_chunk(TextChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason: Some(reason),
                });
                self.pending.push_back(e);
            }
        }
    }

    fn usage(&mut self) {
        let usage = UsageJson::new(self.generation.prompt_tokens, self.completion_tokens);
        let event = match self.meta.format {
            Format::Chat => data(&ChatChunk {
                id: &self.meta.id,
                object: "chat.completion.chunk",
                created: self.meta.created,
                model: &self.meta.model,
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: Vec::new(),
                usage: Some(
                    usage
                        .with_media(&self.generation.prompt_media)
                        .with_reasoning(self.generation.reasoning_tokens()),
                ),
            }),
            Format::Completion => data(&TextCompletion {
                id: &self.meta.id,
                object: "text_completion",
                created: self.meta.created,
                model: &self.meta.model,
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: Vec::new(),
                usage: Some(usage),
            }),
        };
        self.pending.push_back(event);
    }

    fn done(&mut self) {
        self.pending.push_back(Event::default().data("[DONE]"));
        self.finished = true;
    }

    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.finished {
                return None;
            }
            match self.generation.next().await {
                Some(ChoiceEvent {
                    index,
                    event:
                        EngineEvent::Token {
                            text,
                            logprob,
                            events,
                            ..
                        },
                }) => {
                    self.token(index, text, events, logprob);
                }
                Some(ChoiceEvent {
                    index,
                    event:
                        EngineEvent::Finished {
                            reason,
                            text,
                            events,
                            usage,
                        },
                }) => {
                    self.completion_tokens += usage.completion_tokens;
                    if let Some(err) = finish_error(&reason, &self.state) {
                        tracing::info!(id = %self.meta.id, "stream ended early: {}", err.message);
                        self.generation.cancel();
                        self.pending.push_back(data(&err.body()));
                        self.done();
                    } else {
                        self.finish(index, text, events, reason.as_openai());
                    }
                }
                None => {
                    if self.meta.include_usage {
                        self.usage();
                    }
                    self.done();
                }
            }
        }
    }
}

/// The streaming response of a submitted generation.
pub fn respond(
    generation: Generation,
    meta: StreamMeta,
    state: Arc<AppState>,
    guard: ActiveGuard,
) -> Response {
    let choices = generation.choices;
    let mut streamer = Streamer {
        generation,
        meta,
        state,
        pending: VecDeque::new(),
        offsets: vec![0; choices],
        completion_tokens: 0,
        finished: false,
        _guard: guard,
    };
    streamer.start();
    let events = stream::unfold(streamer, |mut s| async move {
        let e = s.next_event().await?;
        Some((Ok::<_, Infallible>(e), s))
    });
    Sse::new(events).into_response()
}
