//! From a parsed request to engine requests and back: prompts are rendered
//! and tokenized, each choice becomes one engine request, and their event
//! streams are merged. Dropping a [`Generation`] drops every engine stream,
//! which cancels the requests and frees their KV blocks.

use std::sync::Arc;
use std::time::Instant;

use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use gemma4_engine::{
    ConstraintFactory, EngineEvent, FinishReason, GenerationRequest, Reading, RequestStream,
    SamplingParams, SoftPrompt, ThinkingBudget, TokenConstraint, Usage,
};

use gemma4_text::{ChannelState, IncrementalDecoder, Marker, ProtocolTokens};

use crate::admission::{check_choice_count, limit_error, submit_error};
use crate::error::ApiError;
use crate::front::OpenAiJob;
use crate::grammar::{tool_call_grammar, CallMarkers, GrammarSpec, ThinkingGate};
use crate::openai::fold::{EchoedPrompt, ReplyFold};
use crate::openai::request::{MediaKind, ToolChoice};
use crate::openai::response::MediaTokensJson;
use crate::openai::{ChatRequest, Prompt, Sampling};
use crate::server::{AppState, ModelContext};

/// Runs `f` on the blocking pool (template rendering and tokenization are CPU work).
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}

/// A chat prompt as the engine takes it.
#[derive(Debug, Clone, Default)]
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// The media's soft tokens, when the messages hold images or audio.
    pub soft: Option<Arc<SoftPrompt>>,
    /// Each media item's soft-token count, in prompt order (for `usage`).
    pub media: Vec<MediaTokensJson>,
}

/// Renders a chat request with the model's template and tokenizes it; the
/// media placeholders become their soft tokens.
pub fn chat_prompt(model: &ModelContext, req: &ChatRequest) -> Result<ChatPrompt, ApiError> {
    let template = model.chat_template.as_ref().map_err(|why| {
        ApiError::bad_request(format!(
            "this model cannot serve chat completions: {why}; or use /v1/completions"
        ))
        .with_param("messages")
        .with_code("chat_template_missing")
    })?;
    let items = match (req.media.first(), model.media.as_ref()) {
        (None, _) => Vec::new(),
        (Some(first), None) => {
            let what = match first.kind {
                MediaKind::Image => "no vision tower; it cannot read image_url parts",
                MediaKind::Video => "no vision tower; it cannot read video_url parts",
                MediaKind::Audio => "no audio encoder; it cannot read input_audio parts",
            };
            return Err(ApiError::bad_request(format!("this model has {what}"))
                .with_param(first.param.clone()));
        }
        (Some(_), Some(media)) => media.prepare_all(&req.media, req.max_soft_tokens)?,
    };
    let text = template
        .render(
            &req.messages,
            req.tools.as_ref(),
            req.add_generation_prompt,
            &req.template_kwargs,
        )
        .map_err(|e| {
            ApiError::bad_request(format!("the chat template rejected the messages: {e}"))
                .with_param("messages")
        })?;
    let tokenizer = model.engine.tokenizer();
    let encode = |text: &str, add_bos: bool| {
        tokenizer.encode(text, add_bos).map_err(|e| {
            ApiError::bad_request(format!("cannot tokenize the chat prompt: {e}"))
                .with_param("messages")
        })
    };
    // Templates usually write the BOS token themselves; do not add a second one.
    let has_bos = tokenizer
        .bos_token()
        .is_some_and(|bos| text.starts_with(bos));
    let Some(media) = model.media.as_ref().filter(|_| !items.is_empty()) else {
        return Ok(ChatPrompt {
            ids: encode(&text, !has_bos)?,
            soft: None,
            media: Vec::new(),
        });
    };
    let (pieces, kinds) = crate::media::split_placeholders(&text);
    if !kinds.iter().eq(items.iter().map(|i| &i.kind)) {
        return Err(ApiError::bad_request(format!(
            "the rendered prompt holds {} media placeholders for {} media parts (is {}, {} or {} written in the text?)",
            kinds.len(),
            items.len(),
            crate::media::IMAGE_PLACEHOLDER,
            crate::media::VIDEO_PLACEHOLDER,
            crate::media::AUDIO_PLACEHOLDER,
        ))
        .with_param("messages"));
    }
    let pieces = crate::media::lay_out_frames(&pieces, &items)
        .iter()
        .enumerate()
        .map(|(i, piece)| encode(piece, i == 0 && !has_bos))
        .collect::<Result<Vec<_>, _>>()?;
    let counts = items
        .iter()
        .map(|item| MediaTokensJson {
            kind: item.kind.noun(),
            soft_tokens: item.soft_tokens,
        })
        .collect();
    let (ids, soft) = media.splice(pieces, items);
    Ok(ChatPrompt {
        ids,
        soft: Some(soft),
        media: counts,
    })
}

/// Tokenizes a completion prompt (text gets the tokenizer's usual BOS; the
/// empty text is the start of a document, BOS alone).
pub fn text_prompt(model: &ModelContext, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let tokenizer = model.engine.tokenizer();
    match prompt {
        Prompt::Ids(ids) => Ok(ids.clone()),
        Prompt::Text(text) => {
            let ids = tokenizer.encode(text, true).map_err(|e| {
                ApiError::bad_request(format!("cannot tokenize the prompt: {e}"))
                    .with_param("prompt")
            })?;
            Ok(match (ids.is_empty(), tokenizer.bos_id()) {
                (true, Some(bos)) => vec![bos],
                _ => ids,
            })
        }
    }
}

/// The prompt as a completion echoes it: its text as the tokens spell it
/// (control tokens such as `<bos>` unseen), and where each token starts.
pub fn echoed_prompt(model: &ModelContext, ids: &[u32]) -> Result<EchoedPrompt, ApiError> {
    let tokenizer = model.engine.tokenizer();
    let failed = |e: gemma4_text::TextError| {
        ApiError::bad_request(format!("cannot decode the prompt to echo it: {e}"))
            .with_param("prompt")
    };
    let mut decoder = IncrementalDecoder::new(tokenizer.as_ref());
    let (mut text, mut chars) = (String::new(), 0);
    let mut offsets = Vec::with_capacity(ids.len());
    for &id in ids {
        offsets.push(chars);
        if let Some(piece) = decoder.push(id).map_err(failed)? {
            chars += piece.chars().count();
            text.push_str(&piece);
        }
    }
    if let Some(piece) = decoder.finish().map_err(failed)? {
        text.push_str(&piece);
    }
    let first_token = match ids.first() {
        Some(&id) => tokenizer.decode(&[id], false).map_err(failed)?,
        None => String::new(),
    };
    Ok(EchoedPrompt {
        text,
        first_token,
        offsets,
    })
}

/// What a chat request asks of the protocol tokens.
#[derive(Debug, Clone, Default)]
pub struct ChatControls {
    pub tool_choice: ToolChoice,
    /// More than one call may be made (`parallel_tool_calls`).
    pub parallel_tool_calls: bool,
    /// The request's tool declarations.
    pub tools: Option<serde_json::Value>,
    pub thinking_token_budget: Option<usize>,
    /// The template was asked to let the model think (`enable_thinking`).
    pub thinking: bool,
}

/// The grammar constraint of a request, if it asked for one: for a chat turn
/// that may think, enforcement waits for the thought channel to close.
fn constraint(
    model: &ModelContext,
    sampling: &Sampling,
    chat: Option<&ChatControls>,
    max_tool_calls: usize,
    tokens: &ProtocolTokens,
    prompt: &[u32],
) -> Result<Option<ConstraintFactory>, ApiError> {
    let parallel = chat.is_none_or(|c| c.parallel_tool_calls);
    let forced_call = match chat.map(|c| (&c.tool_choice, c.tools.as_ref())) {
        Some((ToolChoice::Required, tools)) => Some((None, tools)),
        Some((ToolChoice::Auto, Some(_))) if !parallel && sampling.grammar.is_none() => {
            let vocab = model.engine.tokenizer().vocab_size();
            return Ok(one_call(tokens, vocab));
        }
        Some((ToolChoice::Named(name), tools)) => Some((Some(name.as_str()), tools)),
        _ => None,
    };
    let spec = match (forced_call, &sampling.grammar) {
        (Some(_), Some((_, param))) => {
            return Err(ApiError::bad_request(format!(
                "`tool_choice` asks for a tool call and `{param}` for another output; send one"
            ))
            .with_param("tool_choice"))
        }
        (Some((only, tools)), None) => {
            let markers = match (
                tokens.id(Marker::ToolCallOpen),
                tokens.id(Marker::ToolCallClose),
                tokens.id(Marker::StringDelimiter),
                tokens.id(Marker::ToolResponseOpen),
            ) {
                (Some(open), Some(close), Some(quote), Some(end)) => CallMarkers {
                    open,
                    close,
                    quote,
                    end,
                },
                _ => {
                    return Err(ApiError::bad_request(
                        "this model's vocabulary has no tool-call tokens; `tool_choice` cannot force a call",
                    )
                    .with_param("tool_choice"))
                }
            };
            let tools = tools
                .and_then(|t| t.as_array())
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let calls = if parallel { max_tool_calls } else { 1 };
            let lark = tool_call_grammar(tools, only, calls, markers)?;
            (
                GrammarSpec::ToolCalls {
                    lark,
                    quote: markers.quote,
                },
                "tool_choice",
            )
        }
        (None, Some((spec, param))) => (spec.clone(), *param),
        (None, None) => return Ok(None),
    };
    let grammars = model.grammars()?;
    let matcher = grammars.compile(&spec.0, spec.1)?;
    let gate = match (chat, tokens.id(Marker::ChannelOpen)) {
        (Some(c), Some(_)) => {
            let channel = ChannelState::after_prompt(tokens.clone(), prompt);
            (c.thinking || channel.in_thought()).then_some(ThinkingGate { channel })
        }
        _ => None,
    };
    Ok(Some(grammars.constraint(matcher, gate)))
}

/// At most one tool call: once a call has closed, no other may open.
fn one_call(tokens: &ProtocolTokens, vocab: usize) -> Option<ConstraintFactory> {
    let open = tokens.id(Marker::ToolCallOpen)?;
    let close = tokens.id(Marker::ToolCallClose)?;
    let mut mask = vec![u32::MAX; vocab.div_ceil(32)];
    if let Some(word) = mask.get_mut(open as usize / 32) {
        *word &= !(1 << (open % 32));
    }
    let mask = Arc::new(mask);
    Some(ConstraintFactory(Arc::new(move || {
        Box::new(OneCall {
            close,
            closed: false,
            mask: mask.clone(),
        }) as Box<dyn TokenConstraint>
    })))
}

struct OneCall {
    close: u32,
    closed: bool,
    /// Every token but the call marker.
    mask: Arc<Vec<u32>>,
}

impl TokenConstraint for OneCall {
    fn allowed(&mut self) -> Option<&[u32]> {
        self.closed.then_some(self.mask.as_slice())
    }

    fn accept(&mut self, token: u32) {
        self.closed |= token == self.close;
    }
}

/// The logit biases of a request: the client's, plus a ban on the call
/// marker when calls are forbidden.
fn logit_bias(
    sampling: &Sampling,
    chat: Option<&ChatControls>,
    tokens: &ProtocolTokens,
) -> Vec<(u32, f32)> {
    let mut bias = sampling.logit_bias.clone();
    if chat.is_some_and(|c| c.tool_choice == ToolChoice::None) {
        if let Some(id) = tokens.id(Marker::ToolCallOpen) {
            bias.push((id, f32::NEG_INFINITY));
        }
    }
    bias
}

/// The thinking budget of a chat turn (the request's, else the server's).
fn thinking_budget(
    state: &AppState,
    chat: Option<&ChatControls>,
    tokens: &ProtocolTokens,
    prompt: &[u32],
) -> Option<ThinkingBudget> {
    let budget = chat?
        .thinking_token_budget
        .or(state.config.default_thinking_budget)?;
    tokens.id(Marker::ChannelOpen)?;
    tokens.id(Marker::ChannelClose)?;
    Some(ThinkingBudget {
        budget,
        channel: ChannelState::after_prompt(tokens.clone(), prompt),
    })
}

/// One engine request per (prompt, choice), checked against the engine's
/// [`RequestLimits`](gemma4_engine::RequestLimits) (the engine checks the
/// same in its own defence), each error naming the request's field.
/// Choice `j` of prompt `p` gets index `p * n + j` and, with a seed, `seed + j`.
pub(crate) fn build_requests(
    state: &AppState,
    model: &ModelContext,
    job: &OpenAiJob,
) -> Result<Vec<GenerationRequest>, ApiError> {
    let OpenAiJob {
        prompts,
        soft_prompts,
        sampling,
        logprobs,
        arrival,
        prompt_param,
        ..
    } = job;
    let (logprobs, chat) = (*logprobs, job.chat.as_ref());
    check_choice_count(prompts.len() * sampling.n, model.engine.config())?;
    let tokens = ProtocolTokens::new(model.engine.tokenizer());
    let logit_bias = logit_bias(sampling, chat, &tokens);
    let limits = model.engine.limits();
    let mut stop_token_ids = if sampling.ignore_eos {
        Vec::new()
    } else {
        model.stop_token_ids.clone()
    };
    for &id in &sampling.stop_token_ids {
        if !stop_token_ids.contains(&id) {
            stop_token_ids.push(id);
        }
    }
    let deadline = state.config.request_timeout.map(|t| *arrival + t);
    let mut requests = Vec::with_capacity(prompts.len() * sampling.n);
    for (prompt, soft_prompt) in prompts.iter().zip(soft_prompts) {
        let max_tokens = limits
            .max_tokens(
                sampling.max_tokens,
                prompt.len(),
                state.config.default_max_tokens,
            )
            .map_err(|e| limit_error(e, prompt_param))?;
        let thinking_budget = thinking_budget(state, chat, &tokens, prompt);
        let max_calls = state.config.max_tool_calls;
        let constraint = constraint(model, sampling, chat, max_calls, &tokens, prompt)?;
        for j in 0..sampling.n {
            let params = SamplingParams {
                temperature: sampling.temperature,
                top_k: sampling.top_k,
                top_p: sampling.top_p,
                min_p: sampling.min_p,
                presence_penalty: sampling.presence_penalty,
                frequency_penalty: sampling.frequency_penalty,
                repetition_penalty: sampling.repetition_penalty,
                seed: sampling.seed.map(|s| s.wrapping_add(j as u64)),
                max_tokens,
                stop_token_ids: stop_token_ids.clone(),
                stop_strings: sampling.stop.clone(),
                logprobs,
                prompt_logprobs: sampling.prompt_logprobs,
                logit_bias: logit_bias.clone(),
                thinking_budget: thinking_budget.clone(),
                constraint: constraint.clone(),
                plain_decoding: sampling.plain_decoding,
            };
            requests.push(GenerationRequest {
                prompt_ids: prompt.clone(),
                params,
                deadline,
                soft_prompt: soft_prompt.clone(),
                // A chat turn's calls get ids of their own.
                reading: match chat {
                    Some(_) => Reading::Chat {
                        call_id_prefix: format!("{}_", state.response_id("call")),
                    },
                    None => Reading::Text,
                },
                adapter: job.adapter.clone(),
            });
        }
        if let Some(first) = requests.last() {
            limits
                .check(first)
                .map_err(|e| limit_error(e, prompt_param))?;
        }
    }
    Ok(requests)
}

/// An engine event tagged with its choice index.
pub struct ChoiceEvent {
    pub index: usize,
    pub event: EngineEvent,
}

/// The merged event streams of a request's choices.
pub struct Generation {
    streams: SelectAll<BoxStream<'static, ChoiceEvent>>,
    /// Reasoning tokens of the choices that have finished.
    reasoning_tokens: usize,
    /// Prompt tokens, counted once per prompt.
    pub prompt_tokens: usize,
    /// The chat prompt's media items and their soft tokens.
    pub prompt_media: Vec<MediaTokensJson>,
    pub choices: usize,
}

struct Choice {
    index: usize,
    stream: RequestStream,
    state: Arc<AppState>,
    arrival: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    generated: usize,
    done: bool,
}

/// A choice dropped before its end (the client went away, or a refused
/// sibling cancelled it) is counted and logged as cancelled, with its tokens.
impl Drop for Choice {
    fn drop(&mut self) {
        if !self.done {
            self.state.metrics.record_finished(
                FinishReason::Cancelled.as_openai(),
                self.prompt_tokens,
                self.generated,
                self.arrival.elapsed(),
            );
            tracing::info!(
                request = self.stream.id,
                generated = self.generated,
                "request cancelled: its response is no longer wanted"
            );
        }
    }
}

impl Choice {
    async fn next(mut self) -> Option<(ChoiceEvent, Self)> {
        if self.done {
            return None;
        }
        let event = self
            .stream
            .next()
            .await
            .unwrap_or_else(|| EngineEvent::Finished {
                reason: FinishReason::Error(
                    "the engine stopped before finishing the request".into(),
                ),
                text: String::new(),
                events: Vec::new(),
                usage: Usage::default(),
            });
        let now = Instant::now();
        let metrics = &self.state.metrics;
        match &event {
            EngineEvent::Token { .. } => {
                self.generated += 1;
                match self.last_token {
                    None => metrics.record_first_token(now - self.arrival),
                    Some(t) => metrics.record_inter_token(now - t),
                }
                self.last_token = Some(now);
            }
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Finished { reason, usage, .. } => {
                if *reason == FinishReason::Cancelled {
                    tracing::info!(
                        request = self.stream.id,
                        generated = usage.completion_tokens,
                        "request cancelled by the server"
                    );
                }
                metrics.record_finished(
                    reason.as_openai(),
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    now - self.arrival,
                );
                self.done = true;
            }
        }
        Some((
            ChoiceEvent {
                index: self.index,
                event,
            },
            self,
        ))
    }
}

impl Generation {
    /// Submits every request; if one is refused, the ones already queued are cancelled.
    pub fn submit(
        state: &Arc<AppState>,
        model: &ModelContext,
        requests: Vec<GenerationRequest>,
        prompts: &[Vec<u32>],
        arrival: Instant,
    ) -> Result<Self, ApiError> {
        let choices = requests.len();
        let mut streams = SelectAll::new();
        for (index, request) in requests.into_iter().enumerate() {
            let prompt_tokens = request.prompt_ids.len();
            let stream = model.engine.submit(request).map_err(submit_error)?;
            let choice = Choice {
                index,
                stream,
                state: state.clone(),
                arrival,
                last_token: None,
                prompt_tokens,
                generated: 0,
                done: false,
            };
            streams.push(stream::unfold(choice, Choice::next).boxed());
        }
        Ok(Self {
            streams,
            reasoning_tokens: 0,
            prompt_tokens: prompts.iter().map(Vec::len).sum(),
            prompt_media: Vec::new(),
            choices,
        })
    }

    /// The next event of any choice; `None` once all have finished.
    pub async fn next(&mut self) -> Option<ChoiceEvent> {
        let next = self.streams.next().await?;
        if let EngineEvent::Finished { usage, .. } = &next.event {
            self.reasoning_tokens += usage.reasoning_tokens;
        }
        Some(next)
    }

    /// Reasoning tokens of all choices (chat turns) that have finished.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Cancels every choice still running.
    pub fn cancel(&mut self) {
        self.streams.clear();
    }
}

/// The error a client sees for a request that ended abnormally.
pub fn finish_error(reason: &FinishReason, state: &AppState) -> Option<ApiError> {
    match reason {
        FinishReason::Stop
        | FinishReason::StopString(_)
        | FinishReason::ToolCalls
        | FinishReason::Length => None,
        FinishReason::Timeout => {
            let limit = state
                .config
                .request_timeout
                .map(|t| format!(" of {} s", t.as_secs_f64()))
                .unwrap_or_default();
            Some(ApiError::timeout(format!(
                "the request did not finish within the server's request timeout{limit} (--request-timeout); \
                 ask for fewer tokens with max_tokens or retry later"
            )))
        }
        FinishReason::Error(msg) => Some(ApiError::internal(format!("generation failed: {msg}"))),
        FinishReason::Cancelled => Some(ApiError::unavailable(
            "the request was cancelled by the server",
            "cancelled",
        )),
    }
}

/// Folds every choice's events to the end; the first abnormal end is the request's error.
pub async fn fold_to_end(
    generation: &mut Generation,
    mut fold: ReplyFold,
    state: &AppState,
) -> Result<ReplyFold, ApiError> {
    while let Some(ChoiceEvent { index, event }) = generation.next().await {
        if let EngineEvent::Finished { reason, .. } = &event {
            if let Some(err) = finish_error(reason, state) {
                return Err(err);
            }
        }
        fold.apply(index, event);
    }
    Ok(fold)
}
