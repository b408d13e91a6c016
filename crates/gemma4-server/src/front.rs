//! The request front: a parsed chat or completions request becomes one
//! typed job ([`OpenAiJob`]: prompts as token ids, their media, sampling,
//! limits, constraint controls and output options), and a job becomes its
//! engine requests, checked once. Answering, streaming and rendering all
//! start from here, so they agree on what a request runs.

use std::sync::Arc;
use std::time::Instant;

use gemma4_engine::{GenerationRequest, SoftPrompt};

use crate::error::ApiError;
use crate::generation::{
    blocking, build_requests, chat_prompt, echoed_prompt, text_prompt, ChatControls,
};
use crate::openai::fold::PromptOutput;
use crate::openai::request::{Sampling, Streaming, ToolChoice};
use crate::openai::response::MediaTokensJson;
use crate::openai::{ChatRequest, CompletionRequest};
use crate::routes::check_model_name;
use crate::server::{AppState, ModelContext};

/// The parts of an OpenAI chat or completion request that drive generation.
pub(crate) struct OpenAiJob {
    pub prompts: Vec<Vec<u32>>,
    /// Per prompt, its media's soft tokens.
    pub soft_prompts: Vec<Option<Arc<SoftPrompt>>>,
    /// Per prompt, what its choices return of it.
    pub prompt_outputs: Vec<PromptOutput>,
    /// The chat prompt's media items and their soft tokens (for `usage`).
    pub prompt_media: Vec<MediaTokensJson>,
    pub sampling: Sampling,
    pub logprobs: Option<usize>,
    /// Chat requests' tool and thinking controls.
    pub chat: Option<ChatControls>,
    pub streaming: Streaming,
    pub arrival: Instant,
    /// The request field blamed when a prompt breaks a limit.
    pub prompt_param: &'static str,
    /// The LoRA adapter `model` named, if it named one.
    pub adapter: Option<String>,
}

/// A chat request as a job: remote media fetched (within its limits), the
/// messages rendered with the template and tokenized, media encoded.
pub(crate) async fn chat_job(
    state: &Arc<AppState>,
    model: &Arc<ModelContext>,
    mut req: ChatRequest,
    arrival: Instant,
) -> Result<OpenAiJob, ApiError> {
    let adapter = check_model_name(state, req.model.as_deref())?;
    if let Some(media) = model.media.as_ref() {
        if let Some(remote) = media.remote.as_ref() {
            // Too many items are refused before any of them is fetched.
            media.check_counts(&req.media)?;
            remote.fetch_all(&mut req.media).await?;
        }
    }
    let (sampling, logprobs, streaming) = (req.sampling.clone(), req.logprobs, req.streaming);
    let chat = ChatControls {
        tool_choice: req.tool_choice.clone(),
        parallel_tool_calls: req.parallel_tool_calls,
        tools: req.tools.clone(),
        thinking_token_budget: req.thinking_token_budget,
        thinking: req
            .template_kwargs
            .get("enable_thinking")
            .is_some_and(|v| v.as_bool() == Some(true)),
    };
    let prompt = {
        let model = model.clone();
        blocking(move || chat_prompt(&model, &req)).await?
    };
    Ok(OpenAiJob {
        prompts: vec![prompt.ids],
        soft_prompts: vec![prompt.soft],
        prompt_outputs: vec![PromptOutput::default()],
        prompt_media: prompt.media,
        sampling,
        logprobs,
        chat: Some(chat),
        streaming,
        arrival,
        prompt_param: "messages",
        adapter,
    })
}

/// A completions request as a job: each prompt tokenized (and, with `echo`,
/// its text laid out to be returned).
pub(crate) async fn completion_job(
    state: &Arc<AppState>,
    model: &Arc<ModelContext>,
    req: CompletionRequest,
    arrival: Instant,
) -> Result<OpenAiJob, ApiError> {
    let adapter = check_model_name(state, req.model.as_deref())?;
    let (echo, listed) = (req.echo, req.list_prompt_logprobs);
    let prompts: Vec<(Vec<u32>, PromptOutput)> = {
        let model = model.clone();
        let texts = req.prompts;
        blocking(move || {
            texts
                .iter()
                .map(|p| {
                    let ids = text_prompt(&model, p)?;
                    let echo = match echo {
                        true => Some(Arc::new(echoed_prompt(&model, &ids)?)),
                        false => None,
                    };
                    let output = PromptOutput {
                        echo,
                        prompt_logprobs: listed,
                    };
                    Ok((ids, output))
                })
                .collect()
        })
        .await?
    };
    let (prompts, prompt_outputs): (Vec<_>, Vec<_>) = prompts.into_iter().unzip();
    Ok(OpenAiJob {
        soft_prompts: vec![None; prompts.len()],
        prompts,
        prompt_outputs,
        prompt_media: Vec::new(),
        sampling: req.sampling,
        logprobs: req.logprobs,
        chat: None,
        streaming: req.streaming,
        arrival,
        prompt_param: "prompt",
        adapter,
    })
}

/// A job's engine requests (`n` per prompt, in prompt order), every limit
/// checked; built on the blocking pool: the first structured request builds
/// the vocabulary's token trie, and a grammar takes CPU time to write and
/// compile, which must never hold up the threads that answer probes.
pub(crate) async fn engine_requests(
    state: &Arc<AppState>,
    model: &Arc<ModelContext>,
    job: OpenAiJob,
) -> Result<(Vec<GenerationRequest>, OpenAiJob), ApiError> {
    let forces_call = job
        .chat
        .as_ref()
        .is_some_and(|c| matches!(c.tool_choice, ToolChoice::Required | ToolChoice::Named(_)));
    let structured = job.sampling.grammar.is_some() || forces_call;
    let (state, model) = (Arc::clone(state), Arc::clone(model));
    blocking(move || {
        if structured {
            model.grammars()?;
        }
        let requests = build_requests(&state, &model, &job)?;
        Ok((requests, job))
    })
    .await
}
