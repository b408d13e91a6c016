//! `gemma4 generate`: greedy decoding of one prompt.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use gemma4_model::golden::argmax;
use gemma4_model::LogitsFor;
use gemma4_text::IncrementalDecoder;

use crate::model_io::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
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
    let mut stops: Vec<u32> = model.config().eos_token_ids.clone();
    stops.extend(tokenizer.stop_token_ids());
    let mut cache = model.new_cache();
    let logits = model.forward(&prompt, &mut cache, LogitsFor::Last, None)?;
    let mut row = logits.squeeze(0)?.to_vec1::<f32>()?;
    let mut out = Vec::new();
    let mut detok = IncrementalDecoder::new(tokenizer);
    let mut stdout = std::io::stdout();
    for step in 0..args.max_tokens {
        let (next, _) = argmax(&row);
        if !args.ignore_eos && stops.contains(&next) {
            break;
        }
        out.push(next);
        if let Some(text) = detok.push(next)? {
            write!(stdout, "{text}")?;
            stdout.flush()?;
        }
        if step + 1 < args.max_tokens {
            let logits = model.forward(&[next], &mut cache, LogitsFor::Last, None)?;
            row = logits.squeeze(0)?.to_vec1::<f32>()?;
        }
    }
    if let Some(text) = detok.finish()? {
        write!(stdout, "{text}")?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    let ids: Vec<String> = out.iter().map(u32::to_string).collect();
    eprintln!("ids: {}", ids.join(","));
    Ok(ExitCode::SUCCESS)
}
