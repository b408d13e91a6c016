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
use gemma4_engine::EngineEvent;
use serde::Serialize;

use crate::drain::ActiveGuard;
use crate::generation::{finish_error, ChoiceEvent, Generation};
use crate::openai::fold::{ChoiceDelta, Format, ReplyFold};
use crate::openai::response::{ChatChunk, TextCompletion, UsageJson, SYSTEM_FINGERPRINT};
use crate::server::AppState;

/// What every chunk repeats.
pub struct StreamMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
}

struct Streamer {
    generation: Generation,
    fold: ReplyFold,
    meta: StreamMeta,
    state: Arc<AppState>,
    pending: VecDeque<Event>,
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
    /// One chunk per delta.
    fn send(&mut self, deltas: Vec<ChoiceDelta>) {
        for delta in deltas {
            let event = match delta {
                ChoiceDelta::Chat(choice) => data(&ChatChunk {
                    id: &self.meta.id,
                    object: "chat.completion.chunk",
                    created: self.meta.created,
                    model: &self.meta.model,
                    system_fingerprint: SYSTEM_FINGERPRINT,
                    choices: vec![choice],
                    usage: None,
                }),
                ChoiceDelta::Text(choice) => data(&TextCompletion {
                    id: &self.meta.id,
                    object: "text_completion",
                    created: self.meta.created,
                    model: &self.meta.model,
                    system_fingerprint: SYSTEM_FINGERPRINT,
                    choices: vec![choice],
                    usage: None,
                }),
            };
            self.pending.push_back(event);
        }
    }

    fn usage(&mut self) {
        let usage = UsageJson::new(self.generation.prompt_tokens, self.fold.completion_tokens());
        let event = match self.fold.format {
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
                Some(ChoiceEvent { index, event }) => {
                    if let EngineEvent::Finished { reason, .. } = &event {
                        if let Some(err) = finish_error(reason, &self.state) {
                            tracing::info!(id = %self.meta.id, "stream ended early: {}", err.message);
                            self.generation.cancel();
                            self.pending.push_back(data(&err.body()));
                            self.done();
                            continue;
                        }
                    }
                    let deltas = self.fold.apply(index, event);
                    self.send(deltas);
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

/// The streaming response of a submitted generation, chunks folded by `fold`.
pub fn respond(
    generation: Generation,
    fold: ReplyFold,
    meta: StreamMeta,
    state: Arc<AppState>,
    guard: ActiveGuard,
) -> Response {
    let mut streamer = Streamer {
        generation,
        meta,
        state,
        pending: VecDeque::new(),
        finished: false,
        _guard: guard,
        fold,
    };
    let opening = streamer.fold.start();
    streamer.send(opening);
    let events = stream::unfold(streamer, |mut s| async move {
        let e = s.next_event().await?;
        Some((Ok::<_, Infallible>(e), s))
    });
    Sse::new(events).into_response()
}
