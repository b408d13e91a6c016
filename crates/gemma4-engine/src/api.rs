//! What callers (the HTTP server, the CLI) exchange with the engine: a
//! request with its sampling settings in, a stream of events out.

use std::time::Instant;

use gemma4_text::{ChannelState, OutputEvent, Reading};

use crate::speculative::DraftCounts;

/// How to pick each next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 0.0 means no min-p cut.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1.0 means none.
    pub repetition_penalty: f32,
    /// Same seed, same output, whatever else runs in the batch.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation (the text is cut before them).
    pub stop_strings: Vec<String>,
    /// Return the chosen token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Return each prompt token's log-probability given the tokens before it
    /// (all but the first), with this many alternatives. Such a request runs
    /// its whole prompt: it takes nothing from the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Added to a token's logit before any choice (`f32::NEG_INFINITY` bans it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Ends a thought channel once it has this many tokens.
    pub thinking_budget: Option<ThinkingBudget>,
    /// Restricts which tokens may come next (structured output).
    pub constraint: Option<ConstraintFactory>,
    /// Decode one token a step even where the engine drafts (speculative
    /// decoding's output is the same; this turns its work off).
    pub plain_decoding: bool,
}

/// A per-request rule on the next token, such as a grammar.
pub trait TokenConstraint: Send {
    /// Works out the next token's set ahead of [`allowed`](Self::allowed). The
    /// engine calls it on another thread while the model computes the step's
    /// logits, so the work is off the model's critical path.
    fn prepare(&mut self) {}
    /// The tokens allowed next as a bit set over the vocabulary (bit `i % 32` of
    /// word `i / 32`), or `None` when any token may come.
    fn allowed(&mut self) -> Option<&[u32]>;
    /// Records the token that was chosen.
    fn accept(&mut self, token: u32);
}

/// Makes one fresh [`TokenConstraint`] per sequence (each choice of a request
/// gets its own).
#[derive(Clone)]
pub struct ConstraintFactory(
    pub std::sync::Arc<dyn Fn() -> Box<dyn TokenConstraint> + Send + Sync>,
);

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintFactory")
    }
}

impl PartialEq for ConstraintFactory {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A bound on thinking: once `budget` tokens have been generated inside a
/// thought channel (as [`ChannelState`] reads the turn from the prompt's
/// end), the next token closes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkingBudget {
    pub budget: usize,
    /// Where the turn stands at the prompt's end (its tokens name the
    /// channel-closing one).
    pub channel: ChannelState,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            thinking_budget: None,
            constraint: None,
            plain_decoding: false,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    /// The request ends with [`FinishReason::Timeout`] once this passes.
    pub deadline: Option<Instant>,
    /// The prompt's media: the positions read from encoder outputs and the
    /// inputs (pixels, audio features or encoded rows) that fill them.
    pub soft_prompt: Option<std::sync::Arc<crate::media::SoftPrompt>>,
    /// How the output is read: plain text, or a chat turn parsed into events.
    pub reading: Reading,
    /// The LoRA adapter to run with, by name (one the executor loaded);
    /// `None` runs the base model.
    pub adapter: Option<String>,
}

impl GenerationRequest {
    /// A text-only request read as plain text, with no deadline.
    pub fn new(prompt_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            prompt_ids,
            params,
            deadline: None,
            soft_prompt: None,
            reading: Reading::Text,
            adapter: None,
        }
    }
}

/// A token's log-probability with its strongest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub text: String,
    pub logprob: f32,
    /// 1 for the most likely token: one more than the tokens more likely than it.
    pub rank: usize,
    /// `(id, text, logprob)`, best first.
    pub top: Vec<(u32, String, f32)>,
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// One of the request's stop strings (this one) matched.
    StopString(String),
    /// As `Stop`, in a chat turn that completed at least one tool call.
    ToolCalls,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The caller dropped its stream or cancelled.
    Cancelled,
    /// The deadline passed.
    Timeout,
    /// The engine failed on this request.
    Error(String),
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString(_) => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Timeout => "timeout",
            FinishReason::Error(_) => "error",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_prompt_tokens: usize,
    /// Prompt tokens this request computed in whole blocks, which the prefix
    /// cache then keeps for later requests (0 without prefix caching).
    pub cache_written_prompt_tokens: usize,
    /// Generated tokens inside thought channels (chat turns).
    pub reasoning_tokens: usize,
    /// Tokens drafted and accepted by speculative decoding.
    pub speculation: DraftCounts,
}

/// What the engine sends back, in order: the prompt's log-probabilities
/// when asked for (in one or more `PromptLogprobs`), zero or more `Token`s,
/// then one `Finished`.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Log-probabilities of the next prompt tokens, from the second on, in order.
    PromptLogprobs(Vec<TokenLogprob>),
    /// A generated token and the text it completes (may be empty while a
    /// multi-byte character or a possible stop string is pending).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
        /// What the text means in a chat turn (empty for plain text).
        events: Vec<OutputEvent>,
    },
    Finished {
        reason: FinishReason,
        /// Text held back at the end (a partial stop-string match that did not complete).
        text: String,
        /// The chat turn's last events.
        events: Vec<OutputEvent>,
        usage: Usage,
    },
}

impl EngineEvent {
    /// The chat turn's events this event carries.
    pub fn turn_events(&self) -> &[OutputEvent] {
        match self {
            EngineEvent::Token { events, .. } | EngineEvent::Finished { events, .. } => events,
            EngineEvent::PromptLogprobs(_) => &[],
        }
    }
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the wait queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the server is shutting down and accepts no new requests")]
    Draining,
    #[error("{0}")]
    Invalid(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Why a LoRA adapter could not be loaded or unloaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    #[error("a LoRA adapter named `{0}` is loaded already; unload it first")]
    Exists(String),
    #[error("no LoRA adapter named `{0}` is loaded")]
    NotFound(String),
    #[error("the LoRA adapter `{name}` has {requests} request(s) running or waiting; unload it when they end")]
    InUse { name: String, requests: usize },
    #[error("{held} LoRA adapters are loaded, the most the server holds (--max-loras); unload one first")]
    Full { held: usize },
    #[error("the LoRA adapter `{name}` has rank {rank}, above the largest allowed (--max-lora-rank {max})")]
    RankTooHigh {
        name: String,
        rank: usize,
        max: usize,
    },
    #[error("{0}")]
    Load(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// One LoRA adapter's requests, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterLoad {
    pub name: String,
    /// Requests being generated (admitted, preempted ones included).
    pub running: usize,
    /// Requests not yet admitted.
    pub waiting: usize,
    /// Requests submitted with it since the engine started.
    pub requests: u64,
}

/// A point-in-time view of the engine for `/metrics` and `/health`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_block_size: usize,
    pub prefix_cache_hits: u64,
    /// Prompt tokens whose KV came from the prefix cache.
    pub prefix_cache_hit_tokens: u64,
    pub preemptions: u64,
    /// Blocks in use in the sliding-window group and the full-attention group.
    pub kv_sliding_blocks_used: usize,
    pub kv_full_blocks_used: usize,
    /// The most sliding-group blocks any one sequence has held at once.
    pub kv_sliding_blocks_per_seq_peak: usize,
    /// Steps whose batch failed and were run again one sequence at a time.
    pub step_retries: u64,
    /// Kernel jobs that found the thread pool busy (a media encoder beside
    /// a step) and ran on their caller's thread alone.
    pub contended_kernel_jobs: u64,
    /// Requests whose sampler the executor holds (0 once all have ended
    /// and the engine has stepped or idled since).
    pub executor_requests: usize,
    /// Tokens drafted and accepted by speculative decoding, over all requests.
    pub speculation: DraftCounts,
    /// Nanoseconds the executor spent drafting with the model's assistant.
    pub drafting_ns: u64,
}
