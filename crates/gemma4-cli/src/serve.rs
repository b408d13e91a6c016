//! `gemma4 serve`: the OpenAI-compatible HTTP server.
//!
//! The port is bound first, so `/ready` answers 503 "loading" while the
//! model loads on a separate thread. SIGTERM or SIGINT starts a drain: no new
//! requests, running ones finish within `--drain-timeout`, then exit 0.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use gemma4_engine::EngineConfig;
use gemma4_server::mcp::AllowedHosts;
use gemma4_server::media::MaxItems;
use gemma4_server::{ModelContext, Server, ServerConfig, ServerError};
use gemma4_text::ChatTemplate;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

use crate::lora::LoraArgs;
use crate::model_io::ModelArgs;
use crate::speculative::SpeculativeArgs;

/// Context length used when `--max-model-len` is not given (bounded by the model's own).
const DEFAULT_MAX_MODEL_LEN: usize = 4096;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    #[command(flatten)]
    lora: LoraArgs,
    /// Serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
    /// (vLLM's routes): clients with the API key may load adapters from
    /// folders on this machine while the server runs.
    #[arg(long)]
    allow_runtime_lora: bool,
    /// LoRA adapters held at once, at most (`--lora` ones and those loaded
    /// at run time) [default: no limit].
    #[arg(long, value_name = "N")]
    max_loras: Option<usize>,
    /// The largest rank a LoRA adapter may have [default: no limit].
    #[arg(long, value_name = "R")]
    max_lora_rank: Option<usize>,
    /// A llama.cpp multimodal projector file (`mmproj` GGUF: Gemma 4's vision
    /// and audio towers) to read images and audio with; it replaces any
    /// towers of the checkpoint.
    #[arg(long)]
    mmproj: Option<std::path::PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model id shown in /v1/models and expected in requests [default: the model's file or folder name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/* and /generate [env: GEMMA4_API_KEY].
    #[arg(long)]
    api_key: Option<String>,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 16)]
    max_num_seqs: usize,
    /// Requests that may wait beyond those; more get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Prompt plus output tokens per request [default: the model's context length, at most 4096].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Output tokens when a request gives no max_tokens (bounded by the remaining context).
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Most thinking tokens per chat turn when a request gives no thinking_token_budget.
    #[arg(long)]
    thinking_token_budget: Option<usize>,
    /// Most calls in one turn that `tool_choice: "required"` forces with
    /// parallel calls on (the model may end the turn after any of them).
    #[arg(long, default_value_t = 16)]
    max_tool_calls: usize,
    /// Seconds a request may take from arrival to its last token (0: no limit).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Seconds running requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout: f64,
    /// Seconds a connection may take to send a request's headers (idle kept-alive ones too).
    #[arg(long, default_value_t = 30.0)]
    header_read_timeout: f64,
    /// Seconds a request's body may take to arrive after its headers; slower ones get 408.
    #[arg(long, default_value_t = 60.0)]
    body_read_timeout: f64,
    /// Open connections at most; more are answered 503 and closed.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Let browser pages from this origin call the server (repeatable; `*` for any) [default: none].
    #[arg(long = "cors-allow-origin", value_name = "ORIGIN")]
    cors_allow_origin: Vec<String>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    max_body: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Soft tokens per image unless a request's `mm_processor_kwargs` says
    /// otherwise: 70, 140, 280, 560 or 1120 (more reads finer detail).
    /// Default: the checkpoint's `processor_config.json`, else 280.
    #[arg(long, value_parser = parse_soft_tokens)]
    max_soft_tokens: Option<usize>,
    /// Most media items per prompt, as `image=N,audio=M,video=K` (any may be
    /// left out: 8 images, 8 audio clips, 2 videos).
    #[arg(long, default_value = "image=8,audio=8,video=2", value_parser = parse_mm_limit)]
    limit_mm_per_prompt: MaxItems,
    /// Let `image_url` parts name http(s) URLs, fetched by the server (off:
    /// only `data:` URIs are read). Each fetch is bounded by
    /// --media-fetch-timeout, --max-media-bytes and 3 redirects, and one
    /// request's fetches by --media-request-timeout and
    /// --max-media-bytes-per-request.
    #[arg(long)]
    allow_remote_media: bool,
    /// With --allow-remote-media, fetch only from these hosts (comma-separated
    /// names or addresses), at whatever address they resolve to; without it,
    /// any host whose addresses are all public.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "HOSTS",
        requires = "allow_remote_media"
    )]
    allowed_media_domains: Option<Vec<String>>,
    /// With --allow-remote-media, also fetch from loopback, private and
    /// link-local addresses. For tests against a local server only: it lets
    /// any client reach what the server can reach.
    #[arg(long, requires = "allow_remote_media")]
    allow_private_media_hosts: bool,
    /// Seconds one image fetch may take, connecting included (with --allow-remote-media).
    #[arg(long, default_value_t = 10.0)]
    media_fetch_timeout: f64,
    /// Largest image fetched by URL, in bytes (with --allow-remote-media).
    #[arg(long, default_value_t = 20 * 1024 * 1024)]
    max_media_bytes: usize,
    /// Seconds all of one request's media fetches may take together (with
    /// --allow-remote-media).
    #[arg(long, default_value_t = 20.0)]
    media_request_timeout: f64,
    /// Most bytes fetched by URL for one request, over all its parts (with
    /// --allow-remote-media).
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    max_media_bytes_per_request: usize,
    /// Most tokens in one engine step (the prefill chunk size).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// A step admits new prompts while it holds fewer prompt tokens than this: prompts
    /// arriving together are prefilled one step after another, each answering after its
    /// own prefill (raise it to --max-batch-tokens to prefill them all in one step).
    #[arg(long, default_value_t = gemma4_engine::DEFAULT_ADMIT_PROMPT_TOKENS)]
    admit_prompt_tokens: usize,
    /// Soft tokens the media encoders may be encoding at once, beside the engine's steps
    /// (one larger item when nothing else encodes) [default: --max-batch-tokens].
    #[arg(long)]
    encoder_budget: Option<usize>,
    /// KV-cache memory in MiB [default: enough for --max-num-seqs sequences of --max-model-len tokens].
    #[arg(long)]
    kv_memory_mib: Option<usize>,
    /// Element type of the KV cache: f32 (exact, the default), bf16 (half the memory) or
    /// int8 (28%: a byte per value and a scale per 32 values).
    #[arg(long, default_value = "f32", value_parser = |s: &str| s.parse::<gemma4_model::paged::KvDtype>())]
    kv_cache_dtype: gemma4_model::paged::KvDtype,
    /// Do not share KV blocks between requests with the same prompt prefix.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Publish the prefix cache's events (blocks stored and evicted) on a
    /// ZeroMQ PUB socket bound here, such as `tcp://*:5557`, in vLLM's
    /// format, for prefix-aware routers such as llm-d's endpoint picker.
    #[arg(long, value_name = "ENDPOINT")]
    kv_events_endpoint: Option<String>,
    /// The topic of every KV-event message (default `kv@<host name>@<served model name>`).
    #[arg(long, requires = "kv_events_endpoint")]
    kv_events_topic: Option<String>,
    /// Do not serve the chat page at `/`.
    #[arg(long)]
    no_webui: bool,
    /// Also serve the model as MCP tools (Streamable HTTP) at /mcp, behind --api-key when set.
    #[arg(long)]
    mcp: bool,
    /// `Host` headers /mcp answers (repeatable; a name or host:port; `*` for
    /// any, behind a proxy that checks them) [default: localhost, 127.0.0.1, ::1].
    #[arg(long = "mcp-allowed-host", value_name = "HOST", requires = "mcp")]
    mcp_allowed_hosts: Vec<String>,
}

/// This machine's name, for the default KV-event topic.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

fn mcp_hosts(hosts: &[String]) -> AllowedHosts {
    match hosts {
        [] => AllowedHosts::Loopback,
        _ if hosts.iter().any(|h| h == "*") => AllowedHosts::Any,
        _ => AllowedHosts::Only(hosts.to_vec()),
    }
}

pub(crate) fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .with_context(|| format!("{flag} must be a non-negative number of seconds"))
}

fn positive_seconds(flag: &str, value: f64) -> Result<Duration> {
    let d = seconds(flag, value)?;
    if d.is_zero() {
        bail!("{flag} must be more than 0 seconds");
    }
    Ok(d)
}

/// The model id: a GGUF file's stem or a checkpoint folder's name.
pub(crate) fn model_name(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gemma4".into())
}

/// Logs to stderr (`RUST_LOG` filters; `info` by default).
pub(crate) fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

pub fn run(args: Args) -> Result<ExitCode> {
    init_logging();
    run_async(serve(args))
}

/// Runs a server to its end on a multi-threaded runtime.
pub(crate) fn run_async(
    server: impl std::future::Future<Output = Result<ExitCode>>,
) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(server);
    // A model still loading when a signal arrived is abandoned, not awaited.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}

async fn serve(args: Args) -> Result<ExitCode> {
    let path = args.model.path()?;
    let request_timeout = seconds("--request-timeout", args.request_timeout)?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("GEMMA4_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let config = ServerConfig {
        served_model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| model_name(&path)),
        api_key,
        header_read_timeout: positive_seconds("--header-read-timeout", args.header_read_timeout)?,
        body_read_timeout: positive_seconds("--body-read-timeout", args.body_read_timeout)?,
        max_connections: args.max_connections,
        cors_allow_origins: args.cors_allow_origin.clone(),
        max_body_bytes: args.max_body,
        request_timeout: (!request_timeout.is_zero()).then_some(request_timeout),
        drain_timeout: seconds("--drain-timeout", args.drain_timeout)?,
        default_max_tokens: args.default_max_tokens.max(1),
        default_thinking_budget: args.thinking_token_budget,
        max_tool_calls: args.max_tool_calls,
        mcp: args.mcp.then(|| mcp_hosts(&args.mcp_allowed_hosts)),
        webui: !args.no_webui,
        runtime_lora: args.allow_runtime_lora,
    };
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if args.max_tool_calls == 0 {
        bail!("--max-tool-calls must be at least 1");
    }
    if args.max_num_seqs == 0 {
        bail!("--max-num-seqs must be at least 1");
    }
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let kv_events = match &args.kv_events_endpoint {
        None => None,
        Some(_) if args.no_prefix_caching => {
            bail!("--kv-events-endpoint reports the prefix cache, which --no-prefix-caching turns off")
        }
        Some(endpoint) => {
            let topic = args.kv_events_topic.clone().unwrap_or_else(|| {
                gemma4_server::kv_events::default_topic(&host_name(), &config.served_model_name)
            });
            let events = gemma4_server::kv_events::KvEventsConfig {
                endpoint: endpoint.clone(),
                topic,
                block_size: args.block_size.max(1),
            };
            Some(
                gemma4_server::kv_events::publish(events)
                    .await
                    .map_err(anyhow::Error::msg)?,
            )
        }
    };
    let server = Server::new(config).context("cannot set up metrics")?;
    let (mut term, mut int) = install_signals()?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("received SIGTERM"),
            _ = int.recv() => tracing::info!("received SIGINT"),
        }
        // A second signal while draining means: stop now.
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting without waiting for running requests");
            std::process::exit(1);
        });
    };
    let mut http = tokio::spawn(gemma4_server::serve(listener, server.clone(), shutdown));

    tracing::info!(model = %path.display(), "loading model");
    let (tx, rx) = oneshot::channel();
    let model_args = args.model.clone();
    let media = MediaArgs {
        mmproj: args.mmproj.clone(),
        max_soft_tokens: args.max_soft_tokens,
        max_items: args.limit_mm_per_prompt,
        remote: args
            .allow_remote_media
            .then(|| -> Result<_> {
                let limits = gemma4_server::remote_media::RemoteMediaLimits {
                    timeout: positive_seconds("--media-fetch-timeout", args.media_fetch_timeout)?,
                    max_bytes: args.max_media_bytes,
                    max_redirects: 3,
                    request_timeout: positive_seconds(
                        "--media-request-timeout",
                        args.media_request_timeout,
                    )?,
                    max_request_bytes: args.max_media_bytes_per_request,
                };
                let hosts = gemma4_server::remote_media::HostPolicy {
                    allowed_domains: args.allowed_media_domains.clone(),
                    allow_private: args.allow_private_media_hosts,
                };
                Ok((limits, hosts))
            })
            .transpose()?,
    };
    let engine_config = EngineConfig {
        max_num_seqs: args.max_num_seqs,
        max_queue: args.max_queue,
        max_model_len: args.max_model_len.unwrap_or(0),
        block_size: args.block_size.max(1),
        max_batch_tokens: args.max_batch_tokens.max(1),
        admit_prompt_tokens: args.admit_prompt_tokens.max(1),
        kv_memory_bytes: args.kv_memory_mib.map(|m| m.saturating_mul(1024 * 1024)),
        kv_dtype: args.kv_cache_dtype,
        prefix_caching: !args.no_prefix_caching,
        kv_events,
        encoder_budget: args.encoder_budget.map(|n| n.max(1)),
        speculative: args.speculative.config()?,
        max_loras: args.max_loras,
        max_lora_rank: args.max_lora_rank,
    };
    let what = LoadArgs {
        model: model_args,
        media,
        speculative: args.speculative.clone(),
        lora: args.lora.clone(),
        served: server.config().served_model_name.clone(),
    };
    spawn_load(what, engine_config, tx)?;
    tokio::select! {
        loaded = rx => {
            let model = loaded.context("the model-loading thread failed")??;
            server.set_ready(model);
        }
        done = &mut http => return finished(done),
    }
    finished(http.await)
}

fn finished(done: Result<Result<(), ServerError>, tokio::task::JoinError>) -> Result<ExitCode> {
    done.context("the HTTP server task failed")??;
    Ok(ExitCode::SUCCESS)
}

fn install_signals() -> Result<(Signal, Signal)> {
    let term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    Ok((term, int))
}

fn parse_soft_tokens(s: &str) -> std::result::Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    gemma4_media::ImageProcessor::new(n)
        .map(|_| n)
        .map_err(|e| e.to_string())
}

fn parse_mm_limit(s: &str) -> std::result::Result<MaxItems, String> {
    let mut max = MaxItems::default();
    for item in s.split(',') {
        let (kind, n) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?}: expected image=N,audio=M,video=K"))?;
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| format!("{item}: not a number"))?;
        match kind.trim() {
            "image" => max.images = n,
            "audio" => max.audio = n,
            "video" => max.videos = n,
            _ => return Err(format!("{item:?}: expected image=N,audio=M,video=K")),
        }
    }
    Ok(max)
}

/// Media settings for the loading thread.
pub(crate) struct MediaArgs {
    /// The multimodal projector file the towers come from, if one is named.
    pub mmproj: Option<std::path::PathBuf>,
    /// `--max-soft-tokens`, if given.
    pub max_soft_tokens: Option<usize>,
    pub max_items: MaxItems,
    /// Bounds of image fetches by URL and the hosts they may reach, when
    /// they are allowed.
    pub remote: Option<(
        gemma4_server::remote_media::RemoteMediaLimits,
        gemma4_server::remote_media::HostPolicy,
    )>,
}

/// Loads the model and tokenizer and starts the engine.
/// The checkpoint as model listings show it: its format, family, bytes on
/// disk and when it was written (a folder: its safetensors files).
fn model_info(checkpoint: &Path, family: &str) -> gemma4_server::ModelInfo {
    let files: Vec<std::path::PathBuf> = if checkpoint.is_dir() {
        std::fs::read_dir(checkpoint)
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect()
            })
            .unwrap_or_default()
    } else {
        vec![checkpoint.to_path_buf()]
    };
    let meta: Vec<std::fs::Metadata> = files.iter().filter_map(|f| f.metadata().ok()).collect();
    gemma4_server::ModelInfo {
        format: if checkpoint.is_dir() {
            "safetensors"
        } else {
            "gguf"
        }
        .into(),
        family: family.to_owned(),
        size_bytes: meta.iter().map(std::fs::Metadata::len).sum(),
        modified: meta
            .iter()
            .filter_map(|m| m.modified().ok())
            .max()
            .unwrap_or(std::time::UNIX_EPOCH),
    }
}

/// What the loading thread loads: the model, its towers, its assistant and
/// its LoRA adapters (`served`: the name requests give the model itself).
pub(crate) struct LoadArgs {
    pub model: ModelArgs,
    pub media: MediaArgs,
    pub speculative: SpeculativeArgs,
    pub lora: LoraArgs,
    pub served: String,
}

/// Loads the model on a thread of its own; the result goes to `tx`.
pub(crate) fn spawn_load(
    what: LoadArgs,
    engine_config: EngineConfig,
    tx: oneshot::Sender<Result<ModelContext>>,
) -> Result<()> {
    std::thread::Builder::new()
        .name("gemma4-load".into())
        .spawn(move || {
            let _ = tx.send(load(&what, engine_config));
        })
        .context("cannot start the model-loading thread")?;
    Ok(())
}

fn load(what: &LoadArgs, mut engine_config: EngineConfig) -> Result<ModelContext> {
    let (model_args, media, speculative) = (&what.model, &what.media, &what.speculative);
    let loaded = model_args.load()?;
    let adapters = what.lora.load(loaded.model.config(), Some(&what.served))?;
    let checkpoint = loaded.path.clone();
    let (images, audio) = crate::model_io::load_media_encoders(
        &loaded.path,
        media.mmproj.as_deref(),
        loaded.model.config().hidden_size,
    )?;
    let context_len = loaded.model.config().max_position_embeddings;
    engine_config.max_model_len = match engine_config.max_model_len {
        0 => DEFAULT_MAX_MODEL_LEN.min(context_len),
        n if n > context_len => {
            bail!("--max-model-len {n} is larger than the model's context length ({context_len}); lower it")
        }
        n => n,
    };
    // An explicit --chat-template must work; a checkpoint without one still serves completions.
    let template = match &model_args.chat_template {
        Some(_) => Ok(model_args.template(&loaded.tokenizer)?),
        None => ChatTemplate::for_tokenizer(&loaded.tokenizer, None),
    };
    let eos_ids = loaded.model.config().eos_token_ids.clone();
    let info = model_info(&checkpoint, &loaded.model.config().model_type);
    let mut loaded_encoders: Vec<String> = images.iter().map(|e| e.describe()).collect();
    loaded_encoders.extend(audio.iter().map(|a| a.describe()));
    // The executor runs the encoders; the server only prepares their inputs.
    let executor = speculative
        .executor(loaded.model, model_args.policy())?
        .with_encoders(images, audio)
        .context("cannot start the media encoders")?
        .with_adapters(adapters)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = gemma4_engine::start_with(
        Box::new(executor),
        Arc::new(loaded.tokenizer),
        engine_config,
    )
    .context("cannot start the engine")?;
    let facts = engine.media_facts().clone();
    let context = ModelContext::new(engine, template, &eos_ids).with_info(info);
    if loaded_encoders.is_empty() {
        return Ok(context);
    }
    let max_soft_tokens = match media.max_soft_tokens {
        Some(n) => n,
        None if checkpoint.is_dir() => {
            gemma4_media::ProcessorSettings::read(&checkpoint)
                .map_err(anyhow::Error::msg)?
                .max_soft_tokens
        }
        None => 280,
    };
    eprintln!(
        "{}; {} soft tokens per image; at most {} images, {} audio clips and {} videos per prompt",
        loaded_encoders.join("; "),
        max_soft_tokens,
        media.max_items.images,
        media.max_items.audio,
        media.max_items.videos,
    );
    let mut encoders = gemma4_server::media::Media::new(facts, max_soft_tokens, media.max_items);
    if let Some((limits, hosts)) = media.remote.clone() {
        let hosts_said = match (&hosts.allowed_domains, hosts.allow_private) {
            (Some(list), _) => format!("only from {}", list.join(", ")),
            (None, true) => "from any address, private ones included".to_owned(),
            (None, false) => "from public addresses only".to_owned(),
        };
        eprintln!("images by http(s) URL are fetched {hosts_said}");
        let remote = gemma4_server::remote_media::RemoteMedia::new(limits, hosts)
            .map_err(anyhow::Error::msg)?;
        eprintln!(
            "images by http(s) URL are fetched: at most {} bytes, {} s, {} redirects each",
            limits.max_bytes,
            limits.timeout.as_secs_f64(),
            limits.max_redirects
        );
        encoders = encoders.with_remote(remote);
    }
    Ok(context.with_media(encoders))
}
