//! `gemma4 generate`: greedy decoding of one prompt, through the serving
//! engine (its paged cache and attention kernels, as `serve` runs it).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use gemma4_engine::{EngineConfig, EngineEvent, FinishReason, GenerationRequest, SamplingParams};

use crate::lora::LoraArgs;
use crate::model_io::ModelArgs;
use crate::speculative::{self, SpeculativeArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    #[command(flatten)]
    lora: LoraArgs,
    /// Prompt text (tokenized with the checkpoint's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, used as given (include BOS yourself).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Keep generating past end-of-turn and end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let loaded = args.model.load()?;
    let (model, tokenizer) = (&loaded.model, &loaded.tokenizer);
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), None) => tokenizer
            .encode(text, true)
            .context("cannot tokenize the prompt")?,
        (None, Some(ids)) => ids.clone(),
        _ => bail!("give the prompt with --prompt TEXT or --prompt-ids 2,105,..."),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let stop_token_ids = if args.ignore_eos {
        Vec::new()
    } else {
        let mut stops = model.config().eos_token_ids.clone();
        stops.extend(tokenizer.stop_token_ids());
        stops
    };
    let context = prompt.len() + args.max_tokens;
    if context > model.config().max_position_embeddings {
        bail!(
            "{} prompt tokens and --max-tokens {} exceed the model's {} positions",
            prompt.len(),
            args.max_tokens,
            model.config().max_position_embeddings
        );
    }
    if args.max_tokens == 0 {
        println!();
        eprintln!("ids: ");
        return Ok(ExitCode::SUCCESS);
    }
    let speculation = args.speculative.config()?;
    let drafting = speculation.is_some();
    let adapters = args.lora.load(model.config(), None)?;
    if adapters.len() > 1 {
        bail!("generate runs with one LoRA adapter; give --lora once");
    }
    let adapter = adapters.first().map(|a| a.name().to_string());
    let executor = args
        .speculative
        .executor(loaded.model, args.model.policy())?
        .with_adapters(adapters)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = gemma4_engine::start_with(
        Box::new(executor),
        Arc::new(loaded.tokenizer),
        EngineConfig {
            max_num_seqs: 1,
            max_queue: 1,
            max_model_len: context,
            max_batch_tokens: prompt.len().max(1),
            prefix_caching: false,
            speculative: speculation,
            ..EngineConfig::default()
        },
    )?;
    let prompt_len = prompt.len();
    let submitted = Instant::now();
    let mut stream = engine
        .submit(GenerationRequest {
            prompt_ids: prompt,
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: args.max_tokens,
                stop_token_ids,
                ..SamplingParams::default()
            },
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter,
        })
        .context("the engine refused the prompt")?;
    let mut stdout = std::io::stdout();
    let mut ids = Vec::new();
    // When the first and the last token arrived.
    let mut arrivals: Option<(Instant, Instant)> = None;
    let mut drafts = None;
    while let Some(event) = stream.blocking_next() {
        match event {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { id, text, .. } => {
                let now = Instant::now();
                arrivals = Some((arrivals.map_or(now, |(first, _)| first), now));
                ids.push(id.to_string());
                write!(stdout, "{text}")?;
                stdout.flush()?;
            }
            EngineEvent::Finished {
                reason,
                text,
                usage,
                ..
            } => {
                write!(stdout, "{text}")?;
                drafts = drafting.then_some(usage.speculation);
                if let FinishReason::Error(e) = reason {
                    bail!("generation failed: {e}");
                }
                break;
            }
        }
    }
    writeln!(stdout)?;
    stdout.flush()?;
    eprintln!("ids: {}", ids.join(","));
    if let Some((first, last)) = arrivals {
        let mut line = timing(prompt_len, first - submitted, ids.len(), last - first);
        if let Some(counts) = drafts {
            line += &format!("; {}", speculative::describe(&counts));
        }
        eprintln!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// One line on the run's speed: the prompt's tokens and the wait for the
/// first generated token (the prefill), then the rate of the tokens after it
/// (the decode steps).
fn timing(prompt: usize, first_after: Duration, generated: usize, rest: Duration) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut line = format!(
        "timing: prompt {prompt} tokens, first token after {:.1} ms",
        ms(first_after)
    );
    if generated > 1 && !rest.is_zero() {
        let more = generated - 1;
        line += &format!(
            "; {more} more in {:.1} ms ({:.1} tok/s)",
            ms(rest),
            more as f64 / rest.as_secs_f64()
        );
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_names_the_prefill_wait_and_the_decode_rate() {
        let line = timing(7, Duration::from_millis(45), 33, Duration::from_millis(320));
        assert_eq!(
            line,
            "timing: prompt 7 tokens, first token after 45.0 ms; 32 more in 320.0 ms (100.0 tok/s)"
        );
        let one = timing(7, Duration::from_millis(45), 1, Duration::ZERO);
        assert_eq!(one, "timing: prompt 7 tokens, first token after 45.0 ms");
    }
}
