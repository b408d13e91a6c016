//! Speculative decoding's drafting side. A sequence that drafts proposes
//! tokens to follow the one it just sampled; the next step runs them with
//! it, one position each, and the sampler keeps the longest run that it
//! would have chosen itself ([`Sampler::verify`](crate::sampler::Sampler::verify)),
//! plus the token it chooses at the first position that departs. On a CPU,
//! where a decode step reads every weight for one token, checking a few
//! drafted tokens costs little more than one step.
//!
//! Drafts come from prompt lookup (n-gram): the sequence's last `n` tokens
//! are looked up earlier in its own prompt and output, and the tokens that
//! followed are proposed; or from the model's assistant, which the executor
//! runs (`gemma4_model::Assistant`). N-gram drafting costs nothing when
//! there is no match, and a [`DraftPacer`] turns drafting down and then off
//! for a while when drafts keep being rejected, so a sequence whose text
//! the drafter cannot predict decodes as it would without speculation.

/// The most tokens drafted per step: with the token before them, a chunk
/// the CPU executor's attention computes position by position as a
/// one-token step would, so a verified token is the one plain decoding
/// samples bit for bit (past it, attention would run as a prefill does,
/// whose sums may round differently and flip a near tie).
pub const MAX_SPECULATIVE_TOKENS: usize = 7;
/// The longest n-gram looked up.
pub const MAX_NGRAM: usize = 16;

/// How drafts are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftMethod {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence
    /// of the sequence's last `n` tokens, the longest `n` from `max` down to
    /// `min` that occurs.
    Ngram { min: usize, max: usize },
    /// The model's assistant (its MTP drafter), which the executor runs
    /// after each step from the target's hidden state and K/V.
    Assistant,
}

/// Speculative decoding for the sequences of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: DraftMethod,
    /// The most tokens drafted for one step.
    pub num_tokens: usize,
    /// Whether a [`DraftPacer`] adapts the count to how drafts fare; when
    /// not, every step drafts `num_tokens`.
    pub paced: bool,
}

/// A speculative setting out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpeculativeError {
    #[error("speculative tokens per step must be from 1 to {MAX_SPECULATIVE_TOKENS}, not {0}")]
    NumTokens(usize),
    #[error(
        "the n-gram lengths must satisfy 1 <= min <= max <= {MAX_NGRAM}, not min {min}, max {max}"
    )]
    Ngram { min: usize, max: usize },
}

impl SpeculativeConfig {
    /// Prompt-lookup drafting of up to `num_tokens` tokens from n-grams of
    /// `min..=max` tokens.
    pub fn ngram(min: usize, max: usize, num_tokens: usize) -> Result<Self, SpeculativeError> {
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&num_tokens) {
            return Err(SpeculativeError::NumTokens(num_tokens));
        }
        if min == 0 || min > max || max > MAX_NGRAM {
            return Err(SpeculativeError::Ngram { min, max });
        }
        Ok(Self {
            method: DraftMethod::Ngram { min, max },
            num_tokens,
            paced: true,
        })
    }

    /// Drafting by the model's assistant, up to `num_tokens` tokens a step.
    pub fn assistant(num_tokens: usize) -> Result<Self, SpeculativeError> {
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&num_tokens) {
            return Err(SpeculativeError::NumTokens(num_tokens));
        }
        Ok(Self {
            method: DraftMethod::Assistant,
            num_tokens,
            paced: true,
        })
    }

    /// The same drafting with `num_tokens` drafted at every step, however
    /// the drafts fare.
    pub fn unpaced(self) -> Self {
        Self {
            paced: false,
            ..self
        }
    }
}

/// What a drafting sequence proposes for its next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proposal {
    /// These tokens.
    Tokens(Vec<u32>),
    /// Up to this many tokens, which the assistant drafts.
    FromAssistant(usize),
}

/// Counts of drafted and accepted tokens, as vLLM's `spec_decode` counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounts {
    /// Steps that verified at least one drafted token.
    pub drafts: u64,
    /// Drafted tokens verified.
    pub draft_tokens: u64,
    /// Drafted tokens the sampler accepted.
    pub accepted_tokens: u64,
}

impl DraftCounts {
    /// Adds one step's verification of `verified` drafted tokens.
    pub fn record(&mut self, verified: usize, accepted: usize) {
        if verified > 0 {
            self.drafts += 1;
            self.draft_tokens += verified as u64;
            self.accepted_tokens += accepted as u64;
        }
    }
}

/// The tokens that followed the latest earlier occurrence of `tokens`' last
/// `n` tokens, for the longest `n` from `max` down to `min` that occurs; at
/// most `k` of them.
pub fn ngram_draft(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (min.max(1)..=max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Occurrences that end before the last token, latest first.
        if let Some(i) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
            let from = i + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// How many tokens a sequence drafts, from how its last drafts fared: the
/// full count while drafts are accepted, one more than the last accepted
/// run after a partial one, and after a draft with nothing accepted half as
/// many, with drafting paused for 1, 3, 7, … up to 63 steps as misses
/// follow each other. A sequence whose drafts keep missing thus spends
/// almost every step as a plain decode.
#[derive(Debug, Clone)]
pub struct DraftPacer {
    max: usize,
    next: usize,
    misses: u32,
    pause: u32,
}

impl DraftPacer {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            next: max,
            misses: 0,
            pause: 0,
        }
    }

    /// Tokens to draft for the coming step (0 while paused).
    pub fn budget(&mut self) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.next
    }

    /// How the step's `drafted` tokens fared: `accepted` of them were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.misses += 1;
            self.next = (self.next / 2).max(1);
            self.pause = (1u32 << self.misses.min(6)) - 1;
        } else {
            self.misses = 0;
            self.next = if accepted == drafted {
                (self.next * 2).min(self.max)
            } else {
                (accepted + 1).min(self.max)
            };
        }
    }
}

/// A drafting sequence's state in the executor: its tokens so far (prompt
/// and accepted output) and its pacing.
#[derive(Debug, Clone)]
pub struct Drafter {
    config: SpeculativeConfig,
    tokens: Vec<u32>,
    pacer: DraftPacer,
}

impl Drafter {
    pub fn new(config: SpeculativeConfig, prompt: Vec<u32>) -> Self {
        Self {
            config,
            tokens: prompt,
            pacer: DraftPacer::new(config.num_tokens),
        }
    }

    /// Takes a step's outcome: `drafted` tokens were verified, and
    /// `sampled` (the accepted drafts and the token after them) joins the
    /// sequence.
    pub fn advance(&mut self, drafted: usize, sampled: &[u32]) {
        self.pacer
            .record(drafted, sampled.len().saturating_sub(1).min(drafted));
        self.tokens.extend_from_slice(sampled);
    }

    /// What to propose to follow the sequence's last token.
    pub fn propose(&mut self) -> Proposal {
        let k = if self.config.paced {
            self.pacer.budget()
        } else {
            self.config.num_tokens
        };
        match self.config.method {
            DraftMethod::Ngram { min, max } => {
                Proposal::Tokens(ngram_draft(&self.tokens, min, max, k))
            }
            DraftMethod::Assistant => Proposal::FromAssistant(k),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest suffix that occurs before wins, its latest occurrence,
    /// and the draft stops at the sequence's end or at `k`.
    #[test]
    fn ngrams_propose_what_followed_the_latest_longest_match() {
        // ... 1 2 3 [9] ... 5 2 3 [7 8] ... 2 3: the 3-gram "x 2 3" fails,
        // "2 3" matches latest at the second occurrence.
        let t = [1, 2, 3, 9, 5, 2, 3, 7, 8, 6, 2, 3];
        assert_eq!(ngram_draft(&t, 1, 3, 4), vec![7, 8, 6, 2]);
        assert_eq!(ngram_draft(&t, 1, 3, 1), vec![7]);
        // A 3-gram match beats a later 1-gram one.
        let t = [4, 5, 6, 1, 2, 6, 0, 4, 5, 6];
        assert_eq!(ngram_draft(&t, 1, 3, 2), vec![1, 2]);
        assert_eq!(ngram_draft(&t, 1, 1, 2), vec![0, 4]);
        // Nothing repeats: no draft; too short for the smallest n: none.
        assert!(ngram_draft(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(ngram_draft(&[1, 2, 1], 2, 3, 4).is_empty());
        assert!(ngram_draft(&t, 1, 3, 0).is_empty());
        // A match just before the end proposes what is left.
        assert_eq!(ngram_draft(&[7, 7], 1, 2, 4), vec![7]);
    }

    /// Misses halve the count and pause drafting for longer and longer;
    /// an accepted run brings it back.
    #[test]
    fn the_pacer_backs_off_on_misses_and_recovers() {
        let mut p = DraftPacer::new(4);
        assert_eq!(p.budget(), 4);
        p.record(4, 0);
        assert_eq!((p.budget(), p.budget()), (0, 2));
        p.record(2, 0);
        let paused: Vec<usize> = (0..4).map(|_| p.budget()).collect();
        assert_eq!(paused, vec![0, 0, 0, 1]);
        p.record(1, 1);
        assert_eq!(p.budget(), 2);
        p.record(2, 2);
        assert_eq!(p.budget(), 4);
        p.record(4, 1);
        assert_eq!(p.budget(), 2);
        // Nothing drafted: nothing learnt.
        p.record(0, 0);
        assert_eq!(p.budget(), 2);
        for _ in 0..20 {
            p.record(1, 0);
        }
        assert_eq!(p.pause, 63);
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        assert!(SpeculativeConfig::ngram(1, 3, 4).is_ok());
        assert_eq!(
            SpeculativeConfig::ngram(1, 3, 0),
            Err(SpeculativeError::NumTokens(0))
        );
        assert_eq!(
            SpeculativeConfig::ngram(1, 3, 8),
            Err(SpeculativeError::NumTokens(8))
        );
        assert!(SpeculativeConfig::ngram(0, 3, 4).is_err());
        assert!(SpeculativeConfig::ngram(4, 3, 4).is_err());
        assert!(SpeculativeConfig::ngram(1, 17, 4).is_err());
    }
}
