//! The serving engine: a KV-cache manager that knows the architecture
//! (shared-KV layers own no cache, sliding layers keep only their window),
//! a continuous-batching scheduler with chunked prefill and preemption that
//! describes each step by sequence id, the executor seam ([`Executor`]:
//! plans of plain ids in, sampled tokens out) with the CPU executor behind
//! it, the output processor (its own thread: detokenizing once, stop
//! strings, the chat turn's events), and the loop that ties them together.
//! The loop survives a panic or an error in a model step (only the
//! requests that fail alone get the error) and reports a panic it cannot
//! recover from through [`EngineHandle::health`].

mod adapters;
pub mod api;
pub mod block_hash;
pub mod cpu_executor;
pub mod encoders;
pub mod engine;
pub mod executor;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod kv_manager;
pub mod limits;
pub mod media;
mod output_processor;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod threaded_executor;

pub use api::{
    AdapterError, AdapterLoad, ConstraintFactory, EngineEvent, EngineStats, FinishReason,
    GenerationRequest, SamplingParams, SubmitError, ThinkingBudget, TokenConstraint, TokenLogprob,
    Usage,
};
#[cfg(feature = "fault-injection")]
pub use cpu_executor::start_with_fault;
pub use cpu_executor::{start, CpuExecutor};
pub use engine::{
    start_with, EngineConfig, EngineHandle, KvEventSink, KvPlanReport, RequestStream,
    DEFAULT_ADMIT_PROMPT_TOKENS,
};
pub use executor::{AdapterFacts, AdapterReader, Executor, ReadAdapter};
pub use gemma4_text::{OutputEvent, Reading};
pub use kv_manager::{AdapterKey, KvEvent};
pub use limits::{LimitError, RequestLimits, RequestPart, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
pub use media::{
    AudioFacts, EncoderInput, ImageFacts, MediaFacts, SoftItem, SoftPrompt, SoftWindow,
};
pub use speculative::{DraftCounts, DraftMethod, Proposal, SpeculativeConfig, SpeculativeError};
pub use threaded_executor::ThreadedExecutor;

/// The text of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
