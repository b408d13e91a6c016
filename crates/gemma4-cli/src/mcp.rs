//! `gemma4 mcp`: the model as MCP tools over stdin and stdout, for agents
//! that start their tools as child processes. stdout carries the protocol
//! only; logs go to stderr. The client's `initialize` is answered at once;
//! calls made while the model loads are tool errors saying so.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use gemma4_engine::EngineConfig;
use gemma4_server::mcp::McpServer;
use gemma4_server::media::MaxItems;
use gemma4_server::{Server, ServerConfig};
use tokio::sync::oneshot;

use crate::lora::LoraArgs;
use crate::model_io::ModelArgs;
use crate::serve::{init_logging, model_name, run_async, seconds, spawn_load, LoadArgs, MediaArgs};
use crate::speculative::SpeculativeArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    #[command(flatten)]
    lora: LoraArgs,
    /// A llama.cpp multimodal projector file (`mmproj` GGUF) for the model's towers.
    #[arg(long)]
    mmproj: Option<std::path::PathBuf>,
    /// The model's name in `list_models` [default: the model's file or folder name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Calls generated at once; more wait.
    #[arg(long, default_value_t = 4)]
    max_num_seqs: usize,
    /// Prompt plus output tokens per call [default: the model's context length, at most 4096].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Output tokens when a call gives no max_tokens.
    #[arg(long, default_value_t = 512)]
    default_max_tokens: usize,
    /// Most thinking tokens per chat turn.
    #[arg(long)]
    thinking_token_budget: Option<usize>,
    /// Seconds a call may take (0: no limit).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Element type of the KV cache: f32 (exact), bf16 or int8.
    #[arg(long, default_value = "f32", value_parser = |s: &str| s.parse::<gemma4_model::paged::KvDtype>())]
    kv_cache_dtype: gemma4_model::paged::KvDtype,
}

pub fn run(args: Args) -> Result<ExitCode> {
    init_logging();
    if args.max_num_seqs == 0 {
        bail!("--max-num-seqs must be at least 1");
    }
    run_async(serve(args))
}

async fn serve(args: Args) -> Result<ExitCode> {
    let path = args.model.path()?;
    let timeout = seconds("--request-timeout", args.request_timeout)?;
    let config = ServerConfig {
        served_model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| model_name(&path)),
        request_timeout: (!timeout.is_zero()).then_some(timeout),
        default_max_tokens: args.default_max_tokens.max(1),
        default_thinking_budget: args.thinking_token_budget,
        ..ServerConfig::default()
    };
    let server = Server::new(config).context("cannot set up metrics")?;
    tracing::info!(model = %path.display(), "loading model");
    let media = MediaArgs {
        mmproj: args.mmproj.clone(),
        max_soft_tokens: None,
        max_items: MaxItems::default(),
        remote: None,
    };
    let engine_config = EngineConfig {
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len.unwrap_or(0),
        kv_dtype: args.kv_cache_dtype,
        speculative: args.speculative.config()?,
        ..EngineConfig::default()
    };
    let (tx, loaded) = oneshot::channel();
    let model_args = args.model.clone();
    let what = LoadArgs {
        model: model_args,
        media,
        speculative: args.speculative.clone(),
        lora: args.lora.clone(),
        served: server.config().served_model_name.clone(),
    };
    spawn_load(what, engine_config, tx)?;
    let ready = {
        let server = server.clone();
        async move {
            let model = loaded.await.context("the model-loading thread failed")??;
            server.set_ready(model);
            anyhow::Ok(())
        }
    };
    let stdio = McpServer::serve_stdio(&server);
    tokio::pin!(stdio);
    tokio::select! {
        done = &mut stdio => done.context("the MCP connection failed")?,
        loaded = ready => {
            loaded?;
            stdio.await.context("the MCP connection failed")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
