//! Server settings that are not the engine's.

use std::time::Duration;

/// How the HTTP side behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients see in `/v1/models` and must use (or leave empty) in requests.
    pub served_model_name: String,
    /// When set, `/v1/*` and `/generate` need `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// A connection must deliver a request's headers within this (idle kept-alive ones too).
    pub header_read_timeout: Duration,
    /// A request's body must arrive within this once its headers have; else 408.
    pub body_read_timeout: Duration,
    /// Open connections at most; more are answered 503 and closed.
    pub max_connections: usize,
    /// Origins browsers may call from (`*`: any); empty sends no CORS headers.
    pub cors_allow_origins: Vec<String>,
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// Each request ends (with an error) once this has passed since it arrived.
    pub request_timeout: Option<Duration>,
    /// After SIGTERM/SIGINT, how long running requests may take to finish.
    pub drain_timeout: Duration,
    /// Output length when a request gives no `max_tokens` (bounded by the remaining context).
    pub default_max_tokens: usize,
    /// Thinking tokens per chat turn when a request gives no `thinking_token_budget`.
    pub default_thinking_budget: Option<usize>,
    /// Calls at most in one turn forced by `tool_choice: "required"` with
    /// parallel calls (the model may end the turn after any of them).
    pub max_tool_calls: usize,
    /// Serve MCP's Streamable HTTP at `/mcp`, answering these `Host` headers.
    pub mcp: Option<crate::mcp::AllowedHosts>,
    /// Serve the chat page at `/`.
    pub webui: bool,
    /// Serve `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    pub runtime_lora: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            served_model_name: "gemma4".into(),
            api_key: None,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            max_connections: 1024,
            cors_allow_origins: Vec::new(),
            max_body_bytes: 2 * 1024 * 1024,
            request_timeout: Some(Duration::from_secs(600)),
            drain_timeout: Duration::from_secs(30),
            default_max_tokens: 256,
            default_thinking_budget: None,
            max_tool_calls: 16,
            mcp: None,
            webui: true,
            runtime_lora: false,
        }
    }
}
