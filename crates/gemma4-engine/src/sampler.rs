//! Turning one row of logits into the next token: penalties, logit bias,
//! temperature, top-k / top-p / min-p, a per-request seeded generator,
//! log-probs, and a thinking budget that forces the channel closed.
//!
//! The logits arrive already soft-capped by the model, so every
//! probability computed here is of the capped distribution.

use gemma4_text::{ChannelState, Marker};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::api::{SamplingParams, TokenConstraint};

/// Per-request sampling state (the generator and counts of generated tokens).
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens seen in the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
    /// `(token, count)` of generated tokens.
    output_counts: std::collections::HashMap<u32, u32>,
    /// With a thinking budget: where the turn stands, and the tokens
    /// generated in the open thought channel.
    thinking: Option<(ChannelState, usize)>,
    constraint: Option<Box<dyn TokenConstraint>>,
}

/// A sampled token with what the request asked to know about it.
#[derive(Debug, Clone)]
pub struct Sampled {
    pub token: u32,
    /// The token's log-probability, when requested.
    pub logprobs: Option<Scored>,
}

/// A token's log-probability under one distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub logprob: f32,
    /// 1 for the most likely token: one more than the tokens more likely than it.
    pub rank: usize,
    /// The strongest alternatives `(id, logprob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under the softmax of `logits`, with the `k`
/// strongest alternatives.
pub fn score(logits: &[f32], token: u32, k: usize) -> Scored {
    let (lse, top) = log_softmax_top(logits, k);
    let value = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    Scored {
        logprob: value - lse,
        rank: 1 + logits.iter().filter(|&&v| v > value).count(),
        top,
    }
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let mut prompt_tokens = prompt.to_vec();
        prompt_tokens.sort_unstable();
        prompt_tokens.dedup();
        let thinking = params
            .thinking_budget
            .as_ref()
            .map(|b| (b.channel.clone(), 0));
        let constraint = params.constraint.as_ref().map(|make| (make.0)());
        Self {
            params,
            rng,
            prompt_tokens,
            output_counts: Default::default(),
            thinking,
            constraint,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Lends the constraint out (to prepare its next mask elsewhere); give it
    /// back with [`restore_constraint`](Self::restore_constraint) before sampling.
    pub fn take_constraint(&mut self) -> Option<Box<dyn TokenConstraint>> {
        self.constraint.take()
    }

    pub fn restore_constraint(&mut self, constraint: Box<dyn TokenConstraint>) {
        self.constraint = Some(constraint);
    }

    /// Picks the next token from `logits` and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let token = match self.forced_token() {
            Some(token) => token,
            None => {
                let mut x = logits.to_vec();
                self.apply_penalties(&mut x);
                for &(t, bias) in &self.params.logit_bias {
                    if let Some(v) = x.get_mut(t as usize) {
                        *v += bias;
                    }
                }
                if let Some(allowed) = self.constraint.as_mut().and_then(|c| c.allowed()) {
                    mask_disallowed(&mut x, allowed);
                }
                if self.params.temperature <= 0.0 {
                    argmax(&x)
                } else {
                    self.sample_stochastic(&mut x)
                }
            }
        };
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.track_thinking(token);
        if let Some(c) = self.constraint.as_mut() {
            c.accept(token);
        }
        let logprobs = self.params.logprobs.map(|k| score(logits, token, k));
        Sampled { token, logprobs }
    }

    /// Verifies drafted tokens: `rows` holds one row of logits per position
    /// of `drafts.len() + 1`, the first predicting the first draft. Each row
    /// is sampled in turn, as plain decoding would sample it, while the
    /// token chosen is the drafted one; the first token that departs (or the
    /// one after the last draft) ends the run. Greedy output is thus the
    /// same with and without drafts, and since a draft is one fixed token,
    /// keeping it exactly when the sampler draws it is the rejection rule
    /// of speculative sampling: the output is drawn from the target's
    /// distribution.
    pub fn verify(&mut self, rows: &[f32], drafts: &[u32]) -> Vec<Sampled> {
        let vocab = rows.len() / (drafts.len() + 1);
        let mut out = Vec::with_capacity(drafts.len() + 1);
        for (i, row) in rows.chunks(vocab.max(1)).enumerate() {
            let sampled = self.sample(row);
            let hit = drafts.get(i) == Some(&sampled.token);
            out.push(sampled);
            if !hit {
                break;
            }
        }
        out
    }

    /// The channel's closing token once the thinking budget is spent.
    fn forced_token(&self) -> Option<u32> {
        let budget = self.params.thinking_budget.as_ref()?;
        let (channel, spent) = self.thinking.as_ref()?;
        let close = channel.tokens().id(Marker::ChannelClose)?;
        (channel.in_thought() && *spent >= budget.budget).then_some(close)
    }

    fn track_thinking(&mut self, token: u32) {
        let Some((channel, spent)) = self.thinking.as_mut() else {
            return;
        };
        let marker = channel.accept(token);
        *spent = if channel.in_thought() && marker != Some(Marker::ChannelOpen) {
            *spent + 1
        } else {
            0
        };
    }

    fn apply_penalties(&self, x: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0 {
            let seen = self
                .prompt_tokens
                .iter()
                .copied()
                .chain(self.output_counts.keys().copied());
            for t in seen {
                if let Some(v) = x.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                if let Some(v) = x.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
    }

    fn sample_stochastic(&mut self, x: &mut [f32]) -> u32 {
        let p = &self.params;
        for v in x.iter_mut() {
            *v /= p.temperature;
        }
        let (idx, probs) = kept(x, p);
        if idx.is_empty() {
            return 0;
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (k, q) in probs.iter().enumerate() {
            if r < *q {
                return idx[k] as u32;
            }
            r -= q;
        }
        idx[idx.len() - 1] as u32
    }
}

/// Sets every logit whose bit is clear in `allowed` to minus infinity.
fn mask_disallowed(x: &mut [f32], allowed: &[u32]) {
    for (i, v) in x.iter_mut().enumerate() {
        let word = allowed.get(i / 32).copied().unwrap_or(0);
        if word & (1 << (i % 32)) == 0 {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// The candidates the cuts keep (top-k, then min-p, then top-p), best first
/// when any cut applies, with their probabilities; only as many logits are
/// ordered as the cuts can keep.
fn kept(x: &[f32], p: &SamplingParams) -> (Vec<usize>, Vec<f64>) {
    let mut idx: Vec<usize> = (0..x.len()).filter(|&i| x[i].is_finite()).collect();
    if idx.is_empty() {
        return (idx, Vec::new());
    }
    if p.top_k > 0 && p.top_k < idx.len() {
        idx = best_first(x, idx, p.top_k);
    }
    let max = idx.iter().map(|&i| x[i]).fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = idx.iter().map(|&i| f64::from(x[i] - max).exp()).sum();
    let prob = |i: usize| f64::from(x[i] - max).exp() / total;
    if p.top_p < 1.0 || p.min_p > 0.0 {
        // Order only the best few, as many as the cuts below can keep.
        let mut n = 64;
        loop {
            if n >= idx.len() {
                idx.sort_by(|&a, &b| rank(x, a, b));
                break;
            }
            let best = best_first(x, idx.clone(), n);
            let probs: Vec<f64> = best.iter().map(|&i| prob(i)).collect();
            let min_p_cut = p.min_p > 0.0 && probs[n - 1] < probs[0] * f64::from(p.min_p);
            let top_p_cut = p.top_p < 1.0 && probs.iter().sum::<f64>() >= f64::from(p.top_p);
            if min_p_cut || top_p_cut {
                idx = best;
                break;
            }
            n *= 8;
        }
    }
    // Without cuts the order does not matter: nothing is sorted.
    let mut probs: Vec<f64> = idx.iter().map(|&i| prob(i)).collect();
    if p.min_p > 0.0 {
        let cut = probs[0] * f64::from(p.min_p);
        let keep = probs.iter().take_while(|&&q| q >= cut).count().max(1);
        idx.truncate(keep);
        probs.truncate(keep);
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = 0;
        for q in &probs {
            keep += 1;
            acc += q;
            if acc >= f64::from(p.top_p) {
                break;
            }
        }
        idx.truncate(keep);
        probs.truncate(keep);
    }
    (idx, probs)
}

/// Higher logit first, then lower id.
fn rank(x: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    x[b].total_cmp(&x[a]).then(a.cmp(&b))
}

/// The `k` best of `idx`, best first, without sorting the rest.
fn best_first(x: &[f32], mut idx: Vec<usize>, k: usize) -> Vec<usize> {
    idx.select_nth_unstable_by(k - 1, |&a, &b| rank(x, a, b));
    idx.truncate(k);
    idx.sort_by(|&a, &b| rank(x, a, b));
    idx
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// `(log-sum-exp, top-k (id, logprob))` of a logit row.
fn log_softmax_top(x: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut idx: Vec<usize> = (0..x.len()).collect();
    let k = k.min(x.len());
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, |&a, &b| x[b].total_cmp(&x[a]));
    }
    idx.truncate(k);
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
    (
        lse,
        idx.into_iter().map(|i| (i as u32, x[i] - lse)).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ThinkingBudget;
    use gemma4_text::ProtocolTokens;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_the_largest() {
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&[0.1, 3.0, 2.0]).token, 1);
    }

    /// Drafted tokens are kept while greedy sampling picks them; the first
    /// departure is replaced by the sampler's own choice and ends the run.
    #[test]
    fn verification_keeps_the_drafts_the_sampler_picks() {
        let rows = [
            [0.0, 5.0, 1.0], // picks 1 (drafted 1)
            [4.0, 0.0, 1.0], // picks 0 (drafted 0)
            [0.0, 1.0, 3.0], // picks 2 (drafted 1): departs
            [9.0, 0.0, 0.0], // never reached
        ]
        .concat();
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        let out: Vec<u32> = s
            .verify(&rows, &[1, 0, 1])
            .iter()
            .map(|t| t.token)
            .collect();
        assert_eq!(out, vec![1, 0, 2]);
        // Every draft accepted: the token after them comes too.
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        let out: Vec<u32> = s
            .verify(&rows, &[1, 0, 2])
            .iter()
            .map(|t| t.token)
            .collect();
        assert_eq!(out, vec![1, 0, 2, 0]);
        // A repetition penalty sees the accepted drafts as generated tokens.
        let params = SamplingParams {
            repetition_penalty: 100.0,
            ..Default::default()
        };
        let rows = [[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]].concat();
        let mut s = Sampler::new(params, &[]);
        let out: Vec<u32> = s.verify(&rows, &[1]).iter().map(|t| t.token).collect();
        assert_eq!(out, vec![1, 2]);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(params(), &[]);
            (0..20).map(|_| s.sample(&logits).token).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(
            SamplingParams {
                top_k: 1,
                ..params()
            },
            &[],
        );
        for _ in 0..10 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.9, -2.0]).token, 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // p ≈ [0.64, 0.24, 0.09, 0.03]: top_p 0.5 keeps only the first.
        let logits = [2.0, 1.0, 0.0, -1.0];
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 0.5,
                ..params()
            },
            &[],
        );
        assert!((0..20).all(|_| s.sample(&logits).token == 0));
        let mut s = Sampler::new(
            SamplingParams {
                min_p: 0.5,
                ..params()
            },
            &[],
        );
        assert!((0..20).all(|_| s.sample(&logits).token == 0));
    }

    /// The cuts as a plain full sort would make them: the kept ids, best first.
    fn kept_by_full_sort(x: &[f32], p: &SamplingParams) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| rank(x, a, b));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let max = x[idx[0]];
        let total: f64 = idx.iter().map(|&i| f64::from(x[i] - max).exp()).sum();
        let probs: Vec<f64> = idx
            .iter()
            .map(|&i| f64::from(x[i] - max).exp() / total)
            .collect();
        let mut keep = idx.len();
        if p.min_p > 0.0 {
            keep = probs
                .iter()
                .take_while(|&&q| q >= probs[0] * f64::from(p.min_p))
                .count();
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let n = probs.iter().take(keep).take_while(|&&q| {
                let before = acc;
                acc += q;
                before < f64::from(p.top_p)
            });
            keep = n.count();
        }
        idx.truncate(keep.max(1));
        idx
    }

    #[test]
    fn partial_selection_keeps_what_a_full_sort_keeps() {
        let n = 20_000;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 10007) as f32 / 1000.0) - 5.0)
            .collect();
        for (top_k, top_p, min_p) in [
            (0, 0.9, 0.0),
            (0, 0.999, 0.0),
            (0, 1.0, 0.05),
            (40, 1.0, 0.0),
            (40, 0.5, 0.1),
            (0, 0.3, 0.01),
        ] {
            let p = SamplingParams {
                temperature: 1.0,
                top_k,
                top_p,
                min_p,
                seed: Some(3),
                ..Default::default()
            };
            assert_eq!(
                kept(&x, &p).0,
                kept_by_full_sort(&x, &p),
                "top_k {top_k} top_p {top_p} min_p {min_p}"
            );
        }
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 1.0,
                ..Default::default()
            },
            &[],
        );
        assert_eq!(s.sample(&[1.0, 0.5]).token, 0);
        assert_eq!(s.sample(&[1.0, 0.5]).token, 1);
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 4.0,
                ..Default::default()
            },
            &[0],
        );
        assert_eq!(s.sample(&[1.0, 0.5]).token, 1);
    }

    #[test]
    fn logit_bias_bans_and_favours_tokens() {
        let mut s = Sampler::new(
            SamplingParams {
                logit_bias: vec![(0, f32::NEG_INFINITY), (2, 5.0)],
                ..params()
            },
            &[],
        );
        assert!((0..20).all(|_| s.sample(&[9.0, 1.0, 0.0]).token == 2));
    }

    /// Allows only even tokens and records what it was given.
    struct EvenOnly(Vec<u32>, std::sync::Arc<std::sync::Mutex<Vec<u32>>>);

    impl TokenConstraint for EvenOnly {
        fn allowed(&mut self) -> Option<&[u32]> {
            Some(&self.0)
        }
        fn accept(&mut self, token: u32) {
            if let Ok(mut seen) = self.1.lock() {
                seen.push(token);
            }
        }
    }

    #[test]
    fn constraints_mask_greedy_and_sampled_choices() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let factory = crate::api::ConstraintFactory(std::sync::Arc::new(move || {
            Box::new(EvenOnly(vec![0x5555_5555], record.clone())) as Box<dyn TokenConstraint>
        }));
        for temperature in [0.0, 1.0] {
            let mut s = Sampler::new(
                SamplingParams {
                    temperature,
                    constraint: Some(factory.clone()),
                    ..params()
                },
                &[],
            );
            for _ in 0..20 {
                let t = s.sample(&[0.0, 9.0, 1.0, 8.0]).token;
                assert_eq!(t % 2, 0, "temperature {temperature}");
            }
        }
        assert_eq!(seen.lock().map(|s| s.len()).unwrap_or(0), 40);
    }

    #[test]
    fn thinking_budget_forces_the_channel_closed() {
        let tokens =
            ProtocolTokens::from_ids([(0, Marker::ChannelOpen), (1, Marker::ChannelClose)]);
        let budget = ThinkingBudget {
            budget: 3,
            channel: ChannelState::after_prompt(tokens.clone(), &[]),
        };
        let mut s = Sampler::new(
            SamplingParams {
                thinking_budget: Some(budget.clone()),
                ..Default::default()
            },
            &[],
        );
        // Logits always favour token 2 (thinking text); the first token opens the channel.
        let open = s.sample(&[9.0, 0.0, 1.0]).token;
        let rest: Vec<u32> = (0..5).map(|_| s.sample(&[0.0, 0.0, 1.0]).token).collect();
        assert_eq!(open, 0);
        assert_eq!(rest, vec![2, 2, 2, 1, 2]);
        // Starting inside a channel counts from the first token.
        let mut s = Sampler::new(
            SamplingParams {
                thinking_budget: Some(ThinkingBudget {
                    channel: ChannelState::after_prompt(tokens, &[0]),
                    ..budget
                }),
                ..Default::default()
            },
            &[],
        );
        let out: Vec<u32> = (0..4).map(|_| s.sample(&[0.0, 0.0, 1.0]).token).collect();
        assert_eq!(out, vec![2, 2, 2, 1]);
    }

    #[test]
    fn logprobs_are_normalised() {
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: Some(2),
                ..Default::default()
            },
            &[],
        );
        let out = s.sample(&[0.0, 0.0]);
        let scored = out.logprobs.expect("logprobs");
        assert!((scored.logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(scored.top.len(), 2);
        assert_eq!(scored.rank, 1);
        let third = score(&[1.0, 3.0, 2.0, 0.5], 0, 1);
        assert_eq!((third.rank, third.top[0].0), (3, 1));
    }
}
