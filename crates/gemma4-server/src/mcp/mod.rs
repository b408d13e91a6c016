//! The MCP server, on the official Rust SDK (`rmcp`): the model as tools an
//! agent can call (`chat`, `complete`, `count_tokens`, `list_models`,
//! `server_status`), over stdio ([`serve_stdio`], `gemma4 mcp`) or
//! Streamable HTTP ([`http_endpoint`], `gemma4 serve --mcp` at `/mcp`).
//!
//! A call runs as the matching HTTP request would: admitted like one
//! (503-style refusals while loading or draining), its arguments restated
//! as a chat or completions request ([`tools`]), submitted through the same
//! front. Whatever goes wrong with a call (a bad argument, a full queue, a
//! failed generation) is a tool result with `isError` and the reason; only
//! an unknown tool name is a protocol error.

mod reply;
mod tools;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig as ServerInfo,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::front;
use crate::generation::{blocking, text_prompt, Generation};
use crate::openai::Prompt;
use crate::routes::submit_chat;
use crate::server::{AppState, Server};
use reply::{Ended, Progress};
use tools::Counted;

/// Which `Host` headers `/mcp` answers (a guard against DNS rebinding).
#[derive(Debug, Clone, Default)]
pub enum AllowedHosts {
    /// Loopback names only (`localhost`, `127.0.0.1`, `::1`).
    #[default]
    Loopback,
    /// These names or `host:port` authorities.
    Only(Vec<String>),
    /// Any host (behind a proxy or a Kubernetes service that checks it).
    Any,
}

/// The tools of one model server.
#[derive(Clone)]
pub struct McpServer {
    state: Arc<AppState>,
}

impl McpServer {
    /// Serves this server's model over MCP on stdin and stdout until the
    /// client closes them.
    pub async fn serve_stdio(server: &Server) -> Result<(), std::io::Error> {
        let mcp = Self {
            state: server.state(),
        };
        let running = mcp
            .serve(rmcp::transport::stdio())
            .await
            .map_err(std::io::Error::other)?;
        running.waiting().await.map_err(std::io::Error::other)?;
        Ok(())
    }

    async fn call(
        &self,
        name: &str,
        args: &Map<String, Value>,
        cx: &RequestContext<RoleServer>,
    ) -> Result<Value, Ended> {
        match name {
            "chat" => self.chat(args, cx).await,
            "complete" => self.complete(args, cx).await,
            "count_tokens" => self.count_tokens(args).await.map_err(Ended::Failed),
            "list_models" => tools::no_arguments(args)
                .map(|()| self.list_models())
                .map_err(Ended::Failed),
            _ => tools::no_arguments(args)
                .map(|()| self.server_status())
                .map_err(Ended::Failed),
        }
    }

    async fn chat(
        &self,
        args: &Map<String, Value>,
        cx: &RequestContext<RoleServer>,
    ) -> Result<Value, Ended> {
        let arrival = Instant::now();
        let (req, offset) = tools::chat_request(args).map_err(Ended::Failed)?;
        let (model, _guard) = self.state.admit().map_err(Ended::Failed)?;
        let submitted = submit_chat(&self.state, &model, req, arrival)
            .await
            .map_err(|e| Ended::Failed(tools::chat_error(e, offset)))?;
        reply::run(
            submitted.generation,
            true,
            &self.state,
            &cx.ct,
            progress(cx),
        )
        .await
    }

    async fn complete(
        &self,
        args: &Map<String, Value>,
        cx: &RequestContext<RoleServer>,
    ) -> Result<Value, Ended> {
        let arrival = Instant::now();
        let req = tools::completion_request(args).map_err(Ended::Failed)?;
        let (model, _guard) = self.state.admit().map_err(Ended::Failed)?;
        let state = &self.state;
        let generation = async {
            let job = front::completion_job(state, &model, req, arrival).await?;
            let (requests, job) = front::engine_requests(state, &model, job).await?;
            Generation::submit(state, &model, requests, &job.prompts, arrival)
        };
        let generation = generation.await.map_err(Ended::Failed)?;
        reply::run(generation, false, state, &cx.ct, progress(cx)).await
    }

    async fn count_tokens(&self, args: &Map<String, Value>) -> Result<Value, ApiError> {
        let counted = tools::counted(args)?;
        let (model, _guard) = self.state.admit()?;
        let tokens = match counted {
            Counted::Chat(req) => {
                let job = front::chat_job(&self.state, &model, *req, Instant::now()).await?;
                job.prompts.first().map_or(0, Vec::len)
            }
            Counted::Text(text) => {
                let model = model.clone();
                blocking(move || text_prompt(&model, &Prompt::Text(text)))
                    .await?
                    .len()
            }
        };
        Ok(json!({"tokens": tokens, "max_model_len": model.max_model_len()}))
    }

    fn list_models(&self) -> Value {
        let name = &self.state.config.served_model_name;
        let Some(model) = self.state.model() else {
            return json!({"models": [{"id": name, "status": self.state.phase().as_str()}]});
        };
        let (info, can) = (&model.info, model.capabilities());
        let entry = |id: &str, parent: Option<&str>| {
            json!({
                "id": id,
                "parent": parent,
                "status": self.state.phase().as_str(),
                "family": info.family,
                "format": info.format,
                "size_bytes": info.size_bytes,
                "max_model_len": model.max_model_len(),
                "chat": can.chat,
                "images": can.images,
            })
        };
        // The served model, then its LoRA adapters.
        let mut models = vec![entry(name, None)];
        for adapter in &model.engine.adapter_names() {
            models.push(entry(adapter, Some(name)));
        }
        json!({"models": models})
    }

    fn server_status(&self) -> Value {
        let state = &self.state;
        let mut status = json!({
            "model": state.config.served_model_name,
            "status": state.phase().as_str(),
            "generated_tokens": state.metrics.generated_tokens(),
            "decode_tokens_per_second_per_stream": state.metrics.stream_decode_rate(),
        });
        if let Some(reason) = state.engine_failure() {
            status["reason"] = reason.into();
        }
        if let Some(model) = state.model() {
            let stats = model.engine.stats();
            let config = model.engine.config();
            status["running"] = stats.running.into();
            status["waiting"] = stats.waiting.into();
            status["max_num_seqs"] = config.max_num_seqs.into();
            status["max_queue"] = config.max_queue.into();
            status["kv_blocks_used"] = stats.kv_blocks_used.into();
            status["kv_blocks_total"] = stats.kv_blocks_total.into();
            let total = stats.kv_blocks_total.max(1) as f64;
            status["kv_cache_usage"] = (stats.kv_blocks_used as f64 / total).into();
        }
        status
    }
}

/// The call's progress token, if the client sent one.
fn progress(cx: &RequestContext<RoleServer>) -> Option<Progress> {
    cx.meta.get_progress_token().map(|token| Progress {
        peer: cx.peer.clone(),
        token,
    })
}

/// A tool result: the text a model reads, and the whole value as structured content.
fn success(value: Value) -> CallToolResult {
    let text = match value.get("text").and_then(Value::as_str) {
        Some(reply) => reply.to_owned(),
        None => value.to_string(),
    };
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(value);
    result
}

fn failure(e: &ApiError) -> CallToolResult {
    let message = match &e.param {
        Some(param) if !e.message.contains(&format!("`{param}`")) => {
            format!("{} (argument `{param}`)", e.message)
        }
        _ => e.message.clone(),
    };
    CallToolResult::error(vec![ContentBlock::text(message)])
}

impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerInfo {
        ServerInfo::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("gemma4", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "A local Gemma model, `{}`. Call `chat` to ask it something, `complete` to continue a text, \
                 `count_tokens` before sending long inputs, `server_status` to see how busy it is.",
                self.state.config.served_model_name
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools::declarations()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        cx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.as_ref();
        if !tools::NAMES.contains(&name) {
            return Err(ErrorData::invalid_params(
                format!(
                    "there is no tool {name:?}; the tools are {}",
                    tools::NAMES.join(", ")
                ),
                None,
            ));
        }
        let args = request.arguments.unwrap_or_default();
        let result = match self.call(name, &args, &cx).await {
            Ok(value) => success(value),
            Err(Ended::Failed(e)) => failure(&e),
            Err(Ended::Cancelled) => {
                tracing::info!(tool = name, "MCP call cancelled by the client");
                CallToolResult::error(vec![ContentBlock::text("the call was cancelled")])
            }
        };
        Ok(result.into())
    }
}

/// The Streamable HTTP endpoint, to be mounted at `/mcp`: bodies up to the
/// server's `--max-body`, `Host` headers as `hosts` allows.
pub fn http_endpoint(state: Arc<AppState>, hosts: &AllowedHosts) -> Router {
    Router::new()
        .fallback_service(http_service(state, hosts))
        .layer(middleware::from_fn(plain_http_answers))
}

/// Two of the SDK's HTTP answers as clients expect them: a body that is not
/// JSON is JSON-RPC's parse error (400), not 415; a closed session is 204
/// (the Python SDK logs a failure for 202).
async fn plain_http_answers(request: Request, next: Next) -> Response {
    let delete = request.method() == Method::DELETE;
    let response = next.run(request).await;
    match response.status() {
        StatusCode::ACCEPTED if delete => StatusCode::NO_CONTENT.into_response(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => {
            let (parts, body) = response.into_parts();
            let Ok(text) = axum::body::to_bytes(body, 64 * 1024).await else {
                return parts.status.into_response();
            };
            let text = String::from_utf8_lossy(&text);
            if !text.starts_with("fail to deserialize") {
                return Response::from_parts(parts, Body::from(text.into_owned()));
            }
            let error = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700,
                "message": format!("the body is not a JSON-RPC message: {text}")}});
            (StatusCode::BAD_REQUEST, Json(error)).into_response()
        }
        _ => response,
    }
}

fn http_service(
    state: Arc<AppState>,
    hosts: &AllowedHosts,
) -> StreamableHttpService<McpServer, LocalSessionManager> {
    let mut config = StreamableHttpServerConfig::default()
        .with_max_request_body_bytes(state.config.max_body_bytes)
        .with_cancellation_token(state.closing.child_token());
    config = match hosts {
        AllowedHosts::Loopback => config,
        AllowedHosts::Only(list) => config.with_allowed_hosts(list.clone()),
        AllowedHosts::Any => config.disable_allowed_hosts(),
    };
    StreamableHttpService::new(
        move || {
            Ok(McpServer {
                state: state.clone(),
            })
        },
        Arc::new(LocalSessionManager::default()),
        config,
    )
}
