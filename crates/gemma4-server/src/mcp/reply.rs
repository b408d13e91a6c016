//! A `chat` or `complete` call's generation folded into the tool's result:
//! each token reports progress (when the client sent a progress token,
//! with the new text as the message), and a cancelled call drops its
//! generation, which ends the engine's sequence and frees its KV blocks.

use gemma4_engine::{EngineEvent, FinishReason, Usage};
use gemma4_text::OutputEvent;
use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::{Peer, RoleServer};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::generation::{finish_error, ChoiceEvent, Generation};
use crate::server::AppState;

/// Where progress notifications go.
pub struct Progress {
    pub peer: Peer<RoleServer>,
    pub token: ProgressToken,
}

/// Why a call produced no reply.
pub enum Ended {
    /// The client cancelled it.
    Cancelled,
    Failed(ApiError),
}

/// The reply as it is written.
#[derive(Default)]
struct Collected {
    text: String,
    reasoning: String,
    /// Each call's name and arguments (JSON text).
    calls: Vec<(String, String)>,
    tokens: usize,
}

impl Collected {
    /// Takes in one event's text; returns the reply text it added.
    fn take(&mut self, chat: bool, text: &str, events: &[OutputEvent]) -> String {
        if !chat {
            self.text.push_str(text);
            return text.to_owned();
        }
        let mut added = String::new();
        for e in events {
            match e {
                OutputEvent::Content(t) => added.push_str(t),
                OutputEvent::Reasoning(t) => self.reasoning.push_str(t),
                OutputEvent::ToolCallStart { name, .. } => {
                    self.calls.push((name.clone(), String::new()))
                }
                OutputEvent::ToolCallArguments { delta, .. } => {
                    if let Some((_, args)) = self.calls.last_mut() {
                        args.push_str(delta);
                    }
                }
                OutputEvent::ToolCallEnd { .. } => {}
            }
        }
        self.text.push_str(&added);
        added
    }

    fn reply(self, chat: bool, model: &str, reason: &FinishReason, usage: &Usage) -> Value {
        let mut reply = json!({
            "text": self.text,
            "finish_reason": reason.as_openai(),
            "model": model,
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens,
                "reasoning_tokens": usage.reasoning_tokens,
            },
        });
        if chat {
            if !self.reasoning.is_empty() {
                reply["reasoning"] = self.reasoning.into();
            }
            if !self.calls.is_empty() {
                reply["tool_calls"] = self
                    .calls
                    .into_iter()
                    .map(|(name, arguments)| json!({"name": name, "arguments": arguments}))
                    .collect();
            }
        }
        reply
    }
}

/// Runs a one-choice generation to its end: the reply (`chat`: a chat
/// turn's text, reasoning and calls; else the plain text), or why there is none.
pub async fn run(
    mut generation: Generation,
    chat: bool,
    state: &AppState,
    cancelled: &CancellationToken,
    progress: Option<Progress>,
) -> Result<Value, Ended> {
    let mut collected = Collected::default();
    loop {
        let next = tokio::select! {
            biased;
            () = cancelled.cancelled() => {
                generation.cancel();
                return Err(Ended::Cancelled);
            }
            next = generation.next() => next,
        };
        let Some(ChoiceEvent { event, .. }) = next else {
            return Err(Ended::Failed(ApiError::internal(
                "the engine stopped before finishing the request",
            )));
        };
        match event {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { text, events, .. } => {
                collected.tokens += 1;
                let added = collected.take(chat, &text, &events);
                if let Some(p) = &progress {
                    let mut note =
                        ProgressNotificationParam::new(p.token.clone(), collected.tokens as f64);
                    if !added.is_empty() {
                        note = note.with_message(added);
                    }
                    // A client that stopped listening still gets its result.
                    let _ = p.peer.notify_progress(note).await;
                }
            }
            EngineEvent::Finished {
                reason,
                text,
                events,
                usage,
            } => {
                if let Some(e) = finish_error(&reason, state) {
                    return Err(Ended::Failed(e));
                }
                collected.take(chat, &text, &events);
                let model = &state.config.served_model_name;
                return Ok(collected.reply(chat, model, &reason, &usage));
            }
        }
    }
}
