//! The serving engine: a KV-cache manager that knows the architecture
//! (shared-KV layers own no cache, sliding layers keep only their window),
//! a continuous-batching scheduler with chunked prefill and preemption that
//! describes each step by sequence id, the model runner that executes a
//! step and samples, the output processor (its own thread: detokenizing
//! once, stop strings, the chat turn's events), and the loop that ties them together. The loop survives a panic or an error in a model
//! step (only the requests that fail alone get the error) and reports a
//! panic it cannot recover from through [`EngineHandle::health`].

pub mod api;
pub mod block_hash;
pub mod engine;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod kv_manager;
mod output_processor;
pub mod runner;
pub mod sampler;
pub mod scheduler;

pub use api::{
    check_stop_strings, ConstraintFactory, EngineEvent, EngineStats, FinishReason,
    GenerationRequest, SamplingParams, SoftPrompt, SoftWindow, SubmitError, ThinkingBudget,
    TokenConstraint, TokenLogprob, Usage, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES,
};
#[cfg(feature = "fault-injection")]
pub use engine::start_with_fault;
pub use engine::{
    start, EngineConfig, EngineHandle, KvEventSink, KvPlanReport, RequestStream,
    DEFAULT_ADMIT_PROMPT_TOKENS,
};
pub use gemma4_text::{OutputEvent, Reading};
pub use kv_manager::KvEvent;
