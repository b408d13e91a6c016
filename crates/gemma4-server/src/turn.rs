//! One chat turn served through an API whose reply is built by a fold over
//! the output events ([`TurnFold`]: Responses' output items, Anthropic's
//! content blocks): the stream sends the fold's events as they come, the
//! whole reply is the fold's final state, so the two agree by construction.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{stream, StreamExt};
use gemma4_engine::{EngineEvent, FinishReason, Usage};
use gemma4_text::OutputEvent;
use serde_json::Value;

use crate::drain::ActiveGuard;
use crate::error::ApiError;
use crate::generation::{finish_error, Generation};
use crate::openai::response::PromptTokensDetails;
use crate::server::AppState;

/// How the turn ended.
pub enum Ending {
    /// The model ended its turn.
    Completed,
    /// The model ended its turn after calling tools.
    ToolCalls,
    /// One of the request's stop strings (this one) ended the turn.
    StopString(String),
    /// Out of tokens (`max_tokens` or the context).
    Incomplete,
    Failed(ApiError),
}

/// Token counts of the turn.
#[derive(Debug, Clone, Default)]
pub struct TurnUsage {
    pub input: usize,
    /// Input tokens whose KV came from the prefix cache, and those the turn
    /// added to it.
    pub cached: usize,
    pub cache_written: usize,
    pub output: usize,
    pub reasoning: usize,
    /// The input's media, item by item (`None` without media).
    pub media: Option<PromptTokensDetails>,
}

/// An API's reply built from a turn's output events. Each call returns the
/// stream events it causes, JSON objects named by their `type`.
pub trait TurnFold: Send + 'static {
    /// The opening events (the input's counts are known, no output yet).
    fn start(&mut self, usage: &TurnUsage) -> Vec<Value>;
    /// The events that one output event causes.
    fn apply(&mut self, e: &OutputEvent) -> Vec<Value>;
    /// The closing events.
    fn finish(&mut self, ending: &Ending, usage: &TurnUsage) -> Vec<Value>;
    /// The whole reply, once finished.
    fn whole(&mut self) -> Value;
}

/// A submitted turn and its fold.
pub struct Turn<F: TurnFold> {
    fold: F,
    generation: Generation,
    state: Arc<AppState>,
    /// The engine's counts, once the turn has finished.
    engine_usage: Usage,
    ended: bool,
    /// Why the turn failed, for a whole reply's error status.
    failure: Option<ApiError>,
    _guard: ActiveGuard,
}

impl<F: TurnFold> Turn<F> {
    pub fn new(fold: F, generation: Generation, state: Arc<AppState>, guard: ActiveGuard) -> Self {
        Self {
            fold,
            generation,
            state,
            engine_usage: Usage::default(),
            ended: false,
            failure: None,
            _guard: guard,
        }
    }

    /// The next events of the turn, or `None` after the last.
    async fn next_events(&mut self) -> Option<Vec<Value>> {
        if self.ended {
            return None;
        }
        let Some(next) = self.generation.next().await else {
            // Every choice ends with `Finished`; a stream that stops short is an engine failure.
            self.ended = true;
            let e = ApiError::internal("the engine stopped before finishing the request");
            let events = self.fold.finish(&Ending::Failed(e.clone()), &self.usage());
            self.failure = Some(e);
            return Some(events);
        };
        let mut events = Vec::new();
        for e in next.event.turn_events() {
            events.extend(self.fold.apply(e));
        }
        if let EngineEvent::Finished { reason, usage, .. } = &next.event {
            self.engine_usage = *usage;
            self.ended = true;
            let ending = self.ending(reason);
            events.extend(self.fold.finish(&ending, &self.usage()));
            if let Ending::Failed(e) = ending {
                tracing::info!("turn ended early: {}", e.message);
                self.failure = Some(e);
            }
        }
        Some(events)
    }

    fn ending(&mut self, reason: &FinishReason) -> Ending {
        if let Some(e) = finish_error(reason, &self.state) {
            self.generation.cancel();
            return Ending::Failed(e);
        }
        match reason {
            FinishReason::Length => Ending::Incomplete,
            FinishReason::ToolCalls => Ending::ToolCalls,
            FinishReason::StopString(s) => Ending::StopString(s.clone()),
            _ => Ending::Completed,
        }
    }

    fn usage(&self) -> TurnUsage {
        TurnUsage {
            input: self.generation.prompt_tokens,
            cached: self.engine_usage.cached_prompt_tokens,
            cache_written: self.engine_usage.cache_written_prompt_tokens,
            output: self.engine_usage.completion_tokens,
            reasoning: self.engine_usage.reasoning_tokens,
            media: PromptTokensDetails::of(&self.generation.prompt_media),
        }
    }

    /// Runs the turn to its end and returns the whole reply; a failed turn
    /// is the request's error.
    pub async fn whole(mut self) -> Result<Value, ApiError> {
        self.fold.start(&self.usage());
        while self.next_events().await.is_some() {}
        match self.failure {
            Some(e) => Err(e),
            None => Ok(self.fold.whole()),
        }
    }

    /// The fold's events as they come, the opening ones first.
    fn events(mut self) -> impl futures_util::Stream<Item = Value> + Send {
        let pending: VecDeque<Value> = self.fold.start(&self.usage()).into();
        stream::unfold((self, pending), |(mut turn, mut pending)| async move {
            loop {
                if let Some(v) = pending.pop_front() {
                    return Some((v, (turn, pending)));
                }
                pending.extend(turn.next_events().await?);
            }
        })
    }

    /// The turn as server-sent events, each named by its `type`; the stream
    /// ends after the fold's closing events.
    pub fn stream(self) -> Response {
        let events = self.events().map(|v| {
            let kind = v["type"].as_str().unwrap_or("message").to_owned();
            Ok::<_, Infallible>(Event::default().event(kind).data(v.to_string()))
        });
        Sse::new(events).into_response()
    }

    /// The turn as newline-delimited JSON, one event a line.
    pub fn ndjson(self) -> Response {
        let lines = self
            .events()
            .map(|v| Ok::<_, Infallible>(axum::body::Bytes::from(format!("{v}\n"))));
        (
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            axum::body::Body::from_stream(lines),
        )
            .into_response()
    }
}
