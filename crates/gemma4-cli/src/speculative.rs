//! The speculative-decoding flags shared by `serve`, `mcp`, `generate`,
//! `chat` and `bench local`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gemma4_engine::speculative::MAX_SPECULATIVE_TOKENS;
use gemma4_engine::{CpuExecutor, DraftCounts, SpeculativeConfig};
use gemma4_model::{Assistant, Gemma4, LoadPolicy};

/// How drafts are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Prompt lookup: the tokens that followed the last few tokens where
    /// they occurred before, in the prompt or the output.
    Ngram,
    /// The model's assistant (its MTP drafter), given with --draft-model.
    Assistant,
}

#[derive(Debug, Clone, clap::Args)]
pub struct SpeculativeArgs {
    /// Speculative decoding: draft tokens and check them all in one step.
    /// The output is what it would be without (greedy token for token,
    /// sampling from the same distribution).
    #[arg(long, value_enum)]
    speculative: Option<Mode>,
    /// The most tokens drafted per step (1 to 7); by default the
    /// assistant's `num_assistant_tokens` (at most 7), else 4.
    #[arg(long, requires = "speculative")]
    num_speculative_tokens: Option<usize>,
    /// The shortest run of last tokens looked up (ngram).
    #[arg(long, default_value_t = 2, requires = "speculative")]
    ngram_min: usize,
    /// The longest run of last tokens looked up (ngram).
    #[arg(long, default_value_t = 4, requires = "speculative")]
    ngram_max: usize,
    /// The model's assistant checkpoint (a folder with a `gemma4_assistant`
    /// config.json and its safetensors), for `--speculative assistant`.
    #[arg(long, value_name = "DIR")]
    draft_model: Option<PathBuf>,
    /// Draft the full count at every step, however the drafts fare (by
    /// default a sequence whose drafts miss drafts fewer and pauses).
    #[arg(long, requires = "speculative")]
    draft_every_step: bool,
}

impl SpeculativeArgs {
    /// The engine's setting, checked.
    pub fn config(&self) -> Result<Option<SpeculativeConfig>> {
        let k = match (self.num_speculative_tokens, &self.draft_model) {
            (Some(k), _) => k,
            (None, Some(dir)) => assistant_tokens(dir)?.unwrap_or(DEFAULT_TOKENS),
            (None, None) => DEFAULT_TOKENS,
        };
        let paced = |c: SpeculativeConfig| match self.draft_every_step {
            true => c.unpaced(),
            false => c,
        };
        let config = match (self.speculative, &self.draft_model) {
            (None, None) => Ok(None),
            (Some(Mode::Ngram), None) => {
                SpeculativeConfig::ngram(self.ngram_min, self.ngram_max, k)
                    .map(Some)
                    .context("--num-speculative-tokens, --ngram-min and --ngram-max")
            }
            (Some(Mode::Assistant), Some(_)) => SpeculativeConfig::assistant(k)
                .map(Some)
                .context("--num-speculative-tokens"),
            (Some(Mode::Assistant), None) => bail!(
                "--speculative assistant needs --draft-model DIR: the model's assistant checkpoint"
            ),
            (_, Some(_)) => {
                bail!("--draft-model drafts with --speculative assistant; add that flag")
            }
        };
        config.map(|c| c.map(paced))
    }

    /// The CPU executor for `model`, with its assistant loaded (under the
    /// model's load policy) when drafting with one.
    pub fn executor(&self, model: Gemma4, policy: LoadPolicy) -> Result<CpuExecutor> {
        let executor = CpuExecutor::new(model);
        let (Some(Mode::Assistant), Some(dir)) = (self.speculative, &self.draft_model) else {
            return Ok(executor);
        };
        let shown = dir.display();
        let assistant = Assistant::load(dir, policy)
            .with_context(|| format!("cannot load the assistant {shown}"))?;
        let layers = assistant.config().num_layers();
        let executor = executor
            .with_assistant(assistant)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("the assistant {shown} cannot draft for this model"))?;
        tracing::info!(assistant = %shown, layers, "drafting with the model's assistant");
        Ok(executor)
    }
}

/// Tokens drafted per step when neither the flag nor the assistant says.
const DEFAULT_TOKENS: usize = 4;

/// The assistant's `num_assistant_tokens` (its `generation_config.json`),
/// capped at what a step verifies.
fn assistant_tokens(dir: &Path) -> Result<Option<usize>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let Some(n) = json.get("num_assistant_tokens").and_then(|v| v.as_u64()) else {
        return Ok(None);
    };
    let n = usize::try_from(n).unwrap_or(usize::MAX).max(1);
    if n > MAX_SPECULATIVE_TOKENS {
        tracing::info!(
            "the assistant asks for {n} tokens a step; drafting {MAX_SPECULATIVE_TOKENS}, the most a step verifies"
        );
    }
    Ok(Some(n.min(MAX_SPECULATIVE_TOKENS)))
}

/// `drafted D, accepted A (R%)`, for timing lines.
pub fn describe(counts: &DraftCounts) -> String {
    let rate = if counts.draft_tokens == 0 {
        0.0
    } else {
        100.0 * counts.accepted_tokens as f64 / counts.draft_tokens as f64
    };
    format!(
        "drafted {}, accepted {} ({rate:.0}%)",
        counts.draft_tokens, counts.accepted_tokens
    )
}
