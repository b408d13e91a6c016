//! One fold over a generation's events for chat and completions replies:
//! each event adds to its choice's state and yields what a stream sends for
//! it. A stream sends those deltas as chunks; a whole reply is the state
//! once every choice has ended, so the two hold the same by construction.

use std::sync::Arc;

use gemma4_engine::{EngineEvent, TokenLogprob};
use gemma4_text::AssistantMessage;
use serde_json::{Map, Value};

use super::response::{
    prompt_logprob_entry, ChatChoice, ChatChunkChoice, ChatLogprobs, ChatMessage, ChatTokenLogprob,
    CompletionLogprobs, Delta, TextChoice,
};

/// The prompt a completion echoes (`echo`): its text and where each of its
/// tokens starts in it.
#[derive(Debug, Clone, Default)]
pub struct EchoedPrompt {
    pub text: String,
    /// The first token's text (it has no log-probability).
    pub first_token: String,
    /// Character offset in `text` of each prompt token.
    pub offsets: Vec<usize>,
}

/// What a completion returns of its prompt.
#[derive(Debug, Clone, Default)]
pub struct PromptOutput {
    /// `echo`: the reply starts with the prompt (and, with `logprobs`, its
    /// tokens' log-probabilities).
    pub echo: Option<Arc<EchoedPrompt>>,
    /// vLLM's `prompt_logprobs` was asked for.
    pub prompt_logprobs: bool,
}

/// Which reply the events make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Chat,
    Completion,
}

/// One choice's reply so far.
#[derive(Debug, Default)]
pub struct ChoiceState {
    /// The turn as a chat message (chat replies).
    pub message: AssistantMessage,
    /// The text (completions).
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Each token's log-probability, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
    /// Character offset in `text` where each of those tokens starts.
    pub offsets: Vec<usize>,
    /// Characters in `text`.
    chars: usize,
    /// Set once the choice has ended normally.
    pub finish_reason: Option<&'static str>,
    pub completion_tokens: usize,
    /// The echoed prompt, if any.
    echo: Option<Arc<EchoedPrompt>>,
    /// Prompt tokens scored so far (from the second on).
    scored_prompt: usize,
    /// vLLM's `prompt_logprobs`, when asked for.
    prompt_logprobs: Option<Vec<Option<Map<String, Value>>>>,
}

impl ChoiceState {
    fn new(prompt: PromptOutput) -> Self {
        let mut state = Self {
            prompt_logprobs: prompt.prompt_logprobs.then(|| vec![None]),
            ..Self::default()
        };
        if let Some(echo) = &prompt.echo {
            state.text = echo.text.clone();
            state.chars = echo.text.chars().count();
        }
        state.echo = prompt.echo;
        state
    }

    /// Scored prompt tokens: the echoed log-probabilities and vLLM's
    /// `prompt_logprobs` entries they add.
    fn score_prompt(
        &mut self,
        scored: Vec<TokenLogprob>,
        echo_logprobs: bool,
    ) -> (CompletionLogprobs, Vec<Option<Map<String, Value>>>) {
        let (mut echoed, mut listed) = (CompletionLogprobs::default(), Vec::new());
        for lp in scored {
            self.scored_prompt += 1;
            if let Some(list) = self.prompt_logprobs.as_mut() {
                let entry = prompt_logprob_entry(&lp);
                list.push(Some(entry.clone()));
                listed.push(Some(entry));
            }
            if let Some(echo) = self.echo.as_ref().filter(|_| echo_logprobs) {
                let offset = echo.offsets.get(self.scored_prompt).copied().unwrap_or(0);
                echoed.push(&lp, offset);
                self.offsets.push(offset);
                self.logprobs.push(lp);
            }
        }
        (echoed, listed)
    }
}

/// What a stream sends for one event of one choice.
pub enum ChoiceDelta {
    Chat(ChatChunkChoice),
    Text(TextChoice),
}

/// The state of every choice of a chat or completions reply.
pub struct ReplyFold {
    pub format: Format,
    /// The request asked for log-probabilities.
    pub logprobs: bool,
    pub choices: Vec<ChoiceState>,
}

impl ReplyFold {
    /// A fold of `prompts.len()` choices, each returning that of its prompt.
    pub fn new(format: Format, logprobs: bool, prompts: Vec<PromptOutput>) -> Self {
        Self {
            format,
            logprobs,
            choices: prompts.into_iter().map(ChoiceState::new).collect(),
        }
    }

    /// A stream's opening deltas: chat announces the assistant role for each
    /// choice; an echoing completion sends its prompt.
    pub fn start(&self) -> Vec<ChoiceDelta> {
        if self.format == Format::Completion {
            return self.echoes();
        }
        (0..self.choices.len())
            .map(|index| {
                ChoiceDelta::Chat(ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                        ..Delta::default()
                    },
                    logprobs: None,
                    finish_reason: None,
                })
            })
            .collect()
    }

    fn echoes(&self) -> Vec<ChoiceDelta> {
        let logprobs = self.logprobs;
        self.choices
            .iter()
            .enumerate()
            .filter_map(|(index, c)| {
                let echo = c.echo.as_ref()?;
                Some(ChoiceDelta::Text(TextChoice {
                    index,
                    text: echo.text.clone(),
                    logprobs: logprobs.then(|| {
                        let mut l = CompletionLogprobs::default();
                        l.push_unscored(&echo.first_token);
                        l
                    }),
                    finish_reason: None,
                    prompt_logprobs: c.prompt_logprobs.as_ref().map(|_| vec![None]),
                }))
            })
            .collect()
    }

    /// Folds in one event of choice `index` (an abnormal end is the caller's
    /// to report) and returns what a stream sends for it.
    pub fn apply(&mut self, index: usize, event: EngineEvent) -> Vec<ChoiceDelta> {
        let (format, wants_logprobs) = (self.format, self.logprobs);
        let Some(choice) = self.choices.get_mut(index) else {
            return Vec::new();
        };
        match event {
            EngineEvent::PromptLogprobs(scored) => {
                let (echoed, listed) = choice.score_prompt(scored, wants_logprobs);
                if format != Format::Completion || (echoed.tokens.is_empty() && listed.is_empty()) {
                    return Vec::new();
                }
                vec![ChoiceDelta::Text(TextChoice {
                    index,
                    text: String::new(),
                    logprobs: (!echoed.tokens.is_empty()).then_some(echoed),
                    finish_reason: None,
                    prompt_logprobs: (!listed.is_empty()).then_some(listed),
                })]
            }
            EngineEvent::Token {
                id,
                text,
                logprob,
                events,
            } => {
                choice.token_ids.push(id);
                let logprob = logprob.filter(|_| wants_logprobs);
                let offset = choice.chars;
                choice.chars += text.chars().count();
                if let Some(lp) = &logprob {
                    choice.offsets.push(offset);
                    choice.logprobs.push(lp.clone());
                }
                match format {
                    Format::Chat => chat_deltas(index, choice, events, logprob, None),
                    Format::Completion => {
                        choice.text.push_str(&text);
                        if text.is_empty() && logprob.is_none() {
                            return Vec::new();
                        }
                        let logprobs = logprob.map(|lp| {
                            let mut l = CompletionLogprobs::default();
                            l.push(&lp, offset);
                            l
                        });
                        vec![ChoiceDelta::Text(TextChoice {
                            index,
                            text,
                            logprobs,
                            finish_reason: None,
                            prompt_logprobs: None,
                        })]
                    }
                }
            }
            EngineEvent::Finished {
                reason,
                text,
                events,
                usage,
            } => {
                let reason = reason.as_openai();
                choice.finish_reason = Some(reason);
                choice.completion_tokens = usage.completion_tokens;
                match format {
                    Format::Chat => chat_deltas(index, choice, events, None, Some(reason)),
                    Format::Completion => {
                        choice.text.push_str(&text);
                        vec![ChoiceDelta::Text(TextChoice {
                            index,
                            text,
                            logprobs: None,
                            finish_reason: Some(reason),
                            prompt_logprobs: None,
                        })]
                    }
                }
            }
        }
    }

    /// Generated tokens of every choice that has ended.
    pub fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.completion_tokens).sum()
    }

    /// The whole chat reply's choices.
    pub fn chat_choices(self) -> Vec<ChatChoice> {
        let logprobs = self.logprobs;
        self.choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| ChatChoice {
                index,
                logprobs: logprobs.then(|| ChatLogprobs {
                    content: c
                        .logprobs
                        .iter()
                        .map(ChatTokenLogprob::from_engine)
                        .collect(),
                    refusal: None,
                }),
                message: ChatMessage::from_turn(c.message),
                finish_reason: c.finish_reason.unwrap_or("stop"),
            })
            .collect()
    }

    /// The whole completions reply's choices.
    pub fn text_choices(self) -> Vec<TextChoice> {
        let logprobs = self.logprobs;
        self.choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| TextChoice {
                index,
                logprobs: logprobs.then(|| {
                    let mut l = CompletionLogprobs::default();
                    if let Some(echo) = &c.echo {
                        l.push_unscored(&echo.first_token);
                    }
                    for (lp, &offset) in c.logprobs.iter().zip(&c.offsets) {
                        l.push(lp, offset);
                    }
                    l
                }),
                text: c.text,
                finish_reason: c.finish_reason,
                prompt_logprobs: c.prompt_logprobs,
            })
            .collect()
    }
}

/// A chat choice's deltas for one event: one per protocol event (the
/// token's log-probability rides on the first), then the finish reason.
fn chat_deltas(
    index: usize,
    choice: &mut ChoiceState,
    events: Vec<gemma4_text::OutputEvent>,
    mut logprob: Option<TokenLogprob>,
    finish_reason: Option<&'static str>,
) -> Vec<ChoiceDelta> {
    for e in &events {
        choice.message.apply(e);
    }
    let mut deltas: Vec<Delta> = events.into_iter().filter_map(Delta::from_event).collect();
    if deltas.is_empty() && logprob.is_some() {
        deltas.push(Delta::default());
    }
    let mut out: Vec<ChoiceDelta> = deltas
        .into_iter()
        .map(|delta| {
            ChoiceDelta::Chat(ChatChunkChoice {
                index,
                delta,
                logprobs: logprob.take().map(|lp| ChatLogprobs {
                    content: vec![ChatTokenLogprob::from_engine(&lp)],
                    refusal: None,
                }),
                finish_reason: None,
            })
        })
        .collect();
    if finish_reason.is_some() {
        out.push(ChoiceDelta::Chat(ChatChunkChoice {
            index,
            delta: Delta::default(),
            logprobs: None,
            finish_reason,
        }));
    }
    out
}
