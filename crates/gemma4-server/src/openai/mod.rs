//! OpenAI's wire format: request bodies in, response bodies and stream chunks out.

pub mod fold;
pub mod request;
pub mod response;

pub use request::{ChatRequest, CompletionRequest, GenerateRequest, Prompt, Sampling, Streaming};
