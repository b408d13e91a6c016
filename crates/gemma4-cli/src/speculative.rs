//! The speculative-decoding flags shared by `serve`, `mcp`, `generate`,
//! `chat` and `bench local`.

use anyhow::{Context, Result};
use gemma4_engine::{DraftCounts, SpeculativeConfig};

/// How drafts are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Prompt lookup: the tokens that followed the last few tokens where
    /// they occurred before, in the prompt or the output.
    Ngram,
}

#[derive(Debug, Clone, clap::Args)]
pub struct SpeculativeArgs {
    /// Speculative decoding: draft tokens and check them all in one step.
    /// The output is what it would be without (greedy token for token,
    /// sampling from the same distribution).
    #[arg(long, value_enum)]
    speculative: Option<Mode>,
    /// The most tokens drafted per step (1 to 7).
    #[arg(long, default_value_t = 4, requires = "speculative")]
    num_speculative_tokens: usize,
    /// The shortest run of last tokens looked up (ngram).
    #[arg(long, default_value_t = 2, requires = "speculative")]
    ngram_min: usize,
    /// The longest run of last tokens looked up (ngram).
    #[arg(long, default_value_t = 4, requires = "speculative")]
    ngram_max: usize,
}

impl SpeculativeArgs {
    /// The engine's setting, checked.
    pub fn config(&self) -> Result<Option<SpeculativeConfig>> {
        let Some(Mode::Ngram) = self.speculative else {
            return Ok(None);
        };
        SpeculativeConfig::ngram(self.ngram_min, self.ngram_max, self.num_speculative_tokens)
            .map(Some)
            .context("--num-speculative-tokens, --ngram-min and --ngram-max")
    }
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
