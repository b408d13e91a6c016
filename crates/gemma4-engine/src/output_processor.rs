//! The output processor: a thread of its own that turns the engine's
//! sampled token ids into what callers receive: text (each id detokenized
//! once, stop strings), a chat turn's events (reasoning, tool calls,
//! answer), log-prob texts, and the final event. The thread that runs the
//! model never decodes text.
//!
//! A stop string is found here, after the model thread has moved on: the
//! processor sends the request's end back ([`StopNotice`]), ignores any
//! token the engine produced for it meanwhile, and reports the usage as of
//! the token that completed the match.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{mpsc, Arc};

use gemma4_text::{OutputStep, ProtocolTokens, Reading, RequestOutput, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{EngineEvent, FinishReason, TokenLogprob, Usage};
use crate::panic_message;
use crate::sampler::Scored;

/// What the engine tells the processor, in the order it happens.
pub(crate) enum OutputMsg {
    Start {
        id: u64,
        prompt: Vec<u32>,
        stop_strings: Vec<String>,
        reading: Reading,
        events: UnboundedSender<EngineEvent>,
    },
    Token {
        id: u64,
        token: u32,
        /// The token's log-probability when the request asked for it.
        logprobs: Option<Scored>,
    },
    /// Prompt tokens scored in one step, in prompt order.
    PromptLogprobs { id: u64, scored: Vec<(u32, Scored)> },
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
    output: RequestOutput,
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
                protocol: ProtocolTokens::new(&tokenizer),
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
    protocol: ProtocolTokens,
    stops: mpsc::Sender<StopNotice>,
    entries: HashMap<u64, Entry>,
    /// Each token's own text, decoded the first time a log-prob needs it.
    token_texts: HashMap<u32, String>,
}

impl Processor {
    fn handle(&mut self, msg: OutputMsg) {
        match msg {
            OutputMsg::Start {
                id,
                prompt,
                stop_strings,
                reading,
                events,
            } => {
                let output = RequestOutput::new(
                    self.tokenizer.clone(),
                    self.protocol.clone(),
                    &prompt,
                    &stop_strings,
                    &reading,
                );
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
            OutputMsg::PromptLogprobs { id, scored } => {
                let Some(e) = self.entries.get(&id) else {
                    return;
                };
                let logprobs = scored
                    .into_iter()
                    .map(|(token, s)| {
                        token_logprob(&mut self.token_texts, &self.tokenizer, token, s)
                    })
                    .collect();
                let _ = e.events.send(EngineEvent::PromptLogprobs(logprobs));
            }
            OutputMsg::Finished { id, reason, usage } => self.finished(id, reason, usage),
        }
    }

    fn finished(&mut self, id: u64, reason: FinishReason, usage: Usage) {
        let Some(mut e) = self.entries.remove(&id) else {
            return;
        };
        let last = match e.ended {
            Some(_) => Ok(OutputStep::default()),
            None => run_guarded(id, || e.output.finish()),
        };
        let (step, reason) = match (last, e.ended.take()) {
            (Ok(step), Some(ended)) => (step, ended),
            (Ok(step), None) => (step, reason),
            (Err(failed), _) => (OutputStep::default(), failed),
        };
        let reason = match reason {
            FinishReason::Stop if e.output.completed_calls() > 0 => FinishReason::ToolCalls,
            other => other,
        };
        let _ = e.events.send(EngineEvent::Finished {
            reason,
            text: step.text,
            events: step.events,
            usage: Usage {
                completion_tokens: e.accepted,
                reasoning_tokens: e.output.reasoning_tokens(),
                ..usage
            },
        });
    }

    fn token(&mut self, id: u64, token: u32, logprobs: Option<Scored>) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if e.ended.is_some() {
            return;
        }
        e.accepted += 1;
        let logprob =
            logprobs.map(|s| token_logprob(&mut self.token_texts, &self.tokenizer, token, s));
        let ended = match run_guarded(id, || e.output.push(token)) {
            Ok(step) => {
                let _ = e.events.send(EngineEvent::Token {
                    id: token,
                    text: step.text,
                    logprob,
                    events: step.events,
                });
                step.stopped.map(FinishReason::StopString)
            }
            Err(failed) => Some(failed),
        };
        if let Some(reason) = ended {
            e.ended = Some(reason.clone());
            let _ = self.stops.send((id, reason));
        }
    }
}

/// One request's detokenizing: an error or a panic there ends that request only.
fn run_guarded(
    id: u64,
    f: impl FnOnce() -> gemma4_text::Result<OutputStep>,
) -> Result<OutputStep, FinishReason> {
    let msg = match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(step)) => return Ok(step),
        Ok(Err(e)) => e.to_string(),
        Err(payload) => format!("it panicked: {}", panic_message(payload.as_ref())),
    };
    tracing::error!(request = id, "detokenizing failed: {msg}");
    Err(FinishReason::Error(format!("detokenizing failed: {msg}")))
}

/// A scored token with its text and its alternatives' texts.
fn token_logprob(
    texts: &mut HashMap<u32, String>,
    tokenizer: &Tokenizer,
    token: u32,
    scored: Scored,
) -> TokenLogprob {
    TokenLogprob {
        token_id: token,
        text: token_text(texts, tokenizer, token),
        logprob: scored.logprob,
        rank: scored.rank,
        top: scored
            .top
            .into_iter()
            .map(|(t, l)| (t, token_text(texts, tokenizer, t), l))
            .collect(),
    }
}

/// A token's text on its own (for log-probs), decoded once per engine.
fn token_text(cache: &mut HashMap<u32, String>, tokenizer: &Tokenizer, id: u32) -> String {
    cache
        .entry(id)
        .or_insert_with(|| tokenizer.decode(&[id], false).unwrap_or_default())
        .clone()
}
