//! OpenAI-compatible HTTP server for the gemma4 engine.
//!
//! The engine thread owns the model and the KV cache; handlers only talk to
//! it through its channels ([`gemma4_engine::EngineHandle`]) and never block
//! it. The server binds its port before the model is loaded, so `/health`
//! (liveness) answers 200 "loading" and `/ready` (readiness) 503 "loading"
//! until [`Server::set_ready`].
//!
//! * [`routes`]: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//!   `/v1/models/{id}`, `/v1/responses`, Anthropic's `/v1/messages` and
//!   `/v1/messages/count_tokens`, Ollama's `/api/chat`, `/api/generate`,
//!   `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, `/tokenize`, `/detokenize`,
//!   `/tokenizer_info`, `/generate`, `/health`, `/ready`, `/metrics`.
//! * [`webui`]: the chat page at `/`.
//! * [`mcp`]: the model as MCP tools, over stdio or at `/mcp` (`--mcp`).
//! * [`openai`]: request parsing (unknown fields ignored, wrong types a 400
//!   naming the field) and response and chunk shapes.
//! * [`grammar`]: structured output enforced with llguidance token masks.
//! * [`sse`]: streaming in OpenAI's chunk format, ending with `data: [DONE]`.
//! * [`admission`]: body size (413), prompt and output length (400), queue
//!   full (429 with `Retry-After`), draining (503).
//! * [`auth`]: optional bearer key, compared in constant time.
//! * [`metrics`]: Prometheus text.
//! * [`connections`]: the accept loop: header deadline, connection cap.
//! * [`drain`]: SIGTERM/SIGINT handling: stop admitting, finish running
//!   requests up to a timeout, then return.
//!
//! Every error is OpenAI's error JSON, `{"error": {"message", "type", "param",
//! "code"}}` (Anthropic's and Ollama's on theirs), with a message that says how to
//! fix the request.

pub mod admission;
pub mod anthropic;
pub mod auth;
pub mod config;
pub mod connections;
pub mod drain;
pub mod error;
mod fields;
mod front;
pub mod generation;
pub mod grammar;
pub mod kv_events;
pub mod lora_admin;
pub mod mcp;
pub mod media;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod remote_media;
mod render;
mod responses;
pub mod routes;
pub mod server;
pub mod sse;
mod tokenize;
mod turn;
pub mod webui;

pub use config::ServerConfig;
pub use drain::serve;
pub use error::{ApiError, ServerError};
pub use server::{Capabilities, ModelContext, ModelInfo, Phase, Server};
