//! The serving engine: a KV-cache manager that knows the architecture
//! (shared-KV layers own no cache, sliding layers keep only their window),
//! a continuous-batching scheduler with chunked prefill and preemption,
//! the sampler, and the loop that runs batched model steps and streams
//! tokens back to callers.

pub mod api;
pub mod engine;
pub mod kv_manager;
pub mod output;
pub mod sampler;
pub mod scheduler;

pub use api::{
    ConstraintFactory, EngineEvent, EngineStats, FinishReason, GenerationRequest, SamplingParams,
    SubmitError, ThinkingBudget, TokenConstraint, TokenLogprob, Usage,
};
pub use engine::{start, EngineConfig, EngineHandle, KvPlanReport, RequestStream};
