//! The output processor: a thread of its own that turns the engine's
//! sampled token ids into what callers receive: text (incremental
//! detokenization, stop strings), log-prob texts, and the final event. The
//! thread that runs the model never decodes text.
//!
//! A stop string is found here, after the model thread has moved on: the
//! processor sends the request's end back ([`StopNotice`]), ignores any
//! token the engine produced for it meanwhile, and reports the usage as of
//! the token that completed the match.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{mpsc, Arc};

use gemma4_text::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{EngineEvent, FinishReason, SamplingParams, TokenLogprob, Usage};
use crate::output::OutputState;
use crate::runner::panic_message;

/// What the engine tells the processor, in the order it happens.
pub(crate) enum OutputMsg {
    Start {
        id: u64,
        params: SamplingParams,
        events: UnboundedSender<EngineEvent>,
    },
    Token {
        id: u64,
        token: u32,
        /// `(logprob of token, top alternatives)` when the request asked for them.
        logprobs: Option<(f32, Vec<(u32, f32)>)>,
    },
    Finished {
        id: u64,
        reason: FinishReason,
        usage: Usage,
    },
}

/// A request the processor ended (a stop string matched, or its text could
/// not be produced): the engine must stop running it.
pub(crate) type StopNotice = (u64, FinishReason);

struct Entry {
    output: OutputState,
    events: UnboundedSender<EngineEvent>,
    /// Tokens taken into the output.
    accepted: usize,
    /// Set when the processor ended the request itself.
    ended: Option<FinishReason>,
}

/// Starts the processor thread; it ends when the engine drops its sender.
pub(crate) fn spawn(
    tokenizer: Arc<Tokenizer>,
    stops: mpsc::Sender<StopNotice>,
) -> std::io::Result<mpsc::Sender<OutputMsg>> {
    let (tx, rx) = mpsc::channel::<OutputMsg>();
    std::thread::Builder::new()
        .name("gemma4-output".into())
        .spawn(move || {
            let mut p = Processor {
                tokenizer,
                stops,
                entries: HashMap::new(),
                token_texts: HashMap::new(),
            };
            for msg in rx {
                p.handle(msg);
            }
        })?;
    Ok(tx)
}

struct Processor {
    tokenizer: Arc<Tokenizer>,
    stops: mpsc::Sender<StopNotice>,
    entries: HashMap<u64, Entry>,
    /// Each token's own text, decoded the first time a log-prob needs it.
    token_texts: HashMap<u32, String>,
}

impl Processor {
    fn handle(&mut self, msg: OutputMsg) {
        match msg {
            OutputMsg::Start { id, params, events } => {
                let output = OutputState::new(self.tokenizer.clone(), &params);
                self.entries.insert(
                    id,
                    Entry {
                        output,
                        events,
                        accepted: 0,
                        ended: None,
                    },
                );
            }
            OutputMsg::Token {
                id,
                token,
                logprobs,
            } => self.token(id, token, logprobs),
            OutputMsg::Finished { id, reason, usage } => {
                let Some(mut e) = self.entries.remove(&id) else {
                    return;
                };
                let text = match e.ended {
                    Some(_) => String::new(),
                    None => panic::catch_unwind(AssertUnwindSafe(|| e.output.flush()))
                        .unwrap_or_default(),
                };
                let _ = e.events.send(EngineEvent::Finished {
                    reason: e.ended.take().unwrap_or(reason),
                    text,
                    usage: Usage {
                        completion_tokens: e.accepted,
                        ..usage
                    },
                });
            }
        }
    }

    fn token(&mut self, id: u64, token: u32, logprobs: Option<(f32, Vec<(u32, f32)>)>) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if e.ended.is_some() {
            return;
        }
        e.accepted += 1;
        let (texts, tokenizer) = (&mut self.token_texts, &self.tokenizer);
        let logprob = logprobs.map(|(lp, top)| TokenLogprob {
            token_id: token,
            text: token_text(texts, tokenizer, token),
            logprob: lp,
            top: top
                .into_iter()
                .map(|(t, l)| (t, token_text(texts, tokenizer, t), l))
                .collect(),
        });
        // One request's detokenizing: a panic there ends that request only.
        let ended = match panic::catch_unwind(AssertUnwindSafe(|| e.output.push(token))) {
            Ok((text, stopped)) => {
                let _ = e.events.send(EngineEvent::Token {
                    id: token,
                    text,
                    logprob,
                });
                stopped.then_some(FinishReason::Stop)
            }
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                tracing::error!(request = id, "detokenizing panicked: {msg}");
                Some(FinishReason::Error(format!("detokenizing failed: {msg}")))
            }
        };
        if let Some(reason) = ended {
            e.ended = Some(reason.clone());
            let _ = self.stops.send((id, reason));
        }
    }
}

/// A token's text on its own (for log-probs), decoded once per engine.
fn token_text(cache: &mut HashMap<u32, String>, tokenizer: &Tokenizer, id: u32) -> String {
    cache
        .entry(id)
        .or_insert_with(|| tokenizer.decode(&[id], false).unwrap_or_default())
        .clone()
}
