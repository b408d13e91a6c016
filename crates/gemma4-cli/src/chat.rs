//! `gemma4 chat`: an interactive terminal chat, streamed token by token,
//! formatted by the model's own chat template.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use gemma4_engine::{EngineConfig, EngineEvent, FinishReason, GenerationRequest, SamplingParams};
use gemma4_text::TextError;
use serde_json::{json, Map, Value};

use crate::model_io::ModelArgs;
use crate::speculative::SpeculativeArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Let the model think before answering (`enable_thinking`).
    #[arg(long)]
    thinking: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let loaded = args.model.load()?;
    let template = match args.model.template(&loaded.tokenizer) {
        Ok(t) => t,
        Err(e) if matches!(e.downcast_ref::<TextError>(), Some(TextError::NoChatTemplate)) => bail!(
            "{} has no chat template (a base model): use `gemma4 generate --prompt TEXT` for plain completions, or pass --chat-template FILE",
            loaded.path.display()
        ),
        Err(e) => return Err(e),
    };
    let tokenizer = Arc::new(loaded.tokenizer);
    let mut stops = tokenizer.stop_token_ids();
    stops.extend(loaded.model.config().eos_token_ids.iter().copied());
    let max_model_len = loaded.model.config().max_position_embeddings.min(8192);
    let speculative = args.speculative.config()?;
    let executor = args
        .speculative
        .executor(loaded.model, args.model.policy())?;
    let engine = gemma4_engine::start_with(
        Box::new(executor),
        tokenizer.clone(),
        EngineConfig {
            max_num_seqs: 1,
            max_queue: 1,
            max_model_len,
            speculative,
            ..Default::default()
        },
    )?;
    let mut messages: Vec<Value> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    let mut extra = Map::new();
    if args.thinking {
        extra.insert("enable_thinking".into(), Value::Bool(true));
    }
    eprintln!(
        "chatting with {} (empty line or Ctrl-D to quit, /reset to start over)",
        loaded.path.display()
    );
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if line.trim() == "/reset" {
            messages.retain(|m| m["role"] == "system");
            continue;
        }
        messages.push(json!({"role": "user", "content": line.trim_end()}));
        let text = template.render(&Value::Array(messages.clone()), None, true, &extra)?;
        // The template writes <bos> itself; do not add a second one.
        let with_bos = tokenizer.bos_token().is_none_or(|b| !text.starts_with(b));
        let prompt_ids = tokenizer.encode(&text, with_bos)?;
        let budget = max_model_len
            .saturating_sub(prompt_ids.len())
            .min(args.max_tokens);
        if budget == 0 {
            bail!("the conversation no longer fits the context ({max_model_len} tokens); /reset to start over");
        }
        let params = SamplingParams {
            temperature: args.temperature,
            max_tokens: budget,
            stop_token_ids: stops.clone(),
            ..Default::default()
        };
        let mut stream = engine
            .submit(GenerationRequest {
                prompt_ids,
                params,
                deadline: None,
                soft_prompt: None,
                reading: Default::default(),
                adapter: None,
            })
            .context("cannot start the reply")?;
        let mut reply = String::new();
        while let Some(event) = stream.blocking_next() {
            match event {
                EngineEvent::PromptLogprobs(_) => {}
                EngineEvent::Token { text, .. } => {
                    reply.push_str(&text);
                    write!(out, "{text}")?;
                    out.flush()?;
                }
                EngineEvent::Finished { reason, text, .. } => {
                    reply.push_str(&text);
                    writeln!(out, "{text}")?;
                    if let FinishReason::Error(e) = reason {
                        bail!("generation failed: {e}");
                    }
                    break;
                }
            }
        }
        messages.push(json!({"role": "assistant", "content": reply}));
    }
    Ok(ExitCode::SUCCESS)
}
