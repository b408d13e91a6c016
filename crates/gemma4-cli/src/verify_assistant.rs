//! `gemma4 verify --draft-model`: a model's assistant (MTP drafter)
//! against a reference record of speculative decoding, round by round.
//!
//! Each round of the record's rolled-back path (`clean_kv`: the drafter
//! sees the K/V of accepted tokens only) is drafted again from the target's
//! state computed from scratch: the drafted ids must be the reference's and
//! every step's logits within the tolerance. Then each prompt runs through
//! the engine drafting with the assistant at the record's schedule: the
//! output must be the record's and the drafted and accepted counts its sums.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use gemma4_engine::{
    CpuExecutor, EngineConfig, EngineEvent, FinishReason, GenerationRequest, SamplingParams,
    SpeculativeConfig,
};
use gemma4_model::safetensors_store::SafetensorsStore;
use gemma4_model::{Assistant, Gemma4, LoadPolicy};
use gemma4_text::Tokenizer;
use serde_json::Value;

/// One recorded round of the rolled-back path.
struct Round {
    number: u64,
    seq_len: usize,
    drafts: Vec<u32>,
    accepted: usize,
}

/// One prompt of the record.
struct Prompt {
    name: String,
    input_ids: Vec<u32>,
    generated: Vec<u32>,
    rounds: Vec<Round>,
}

fn ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("`{what}` is not a list of token ids"))?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .with_context(|| format!("`{what}` holds {x}, not a token id"))
        })
        .collect()
}

fn count(v: &Value, what: &str) -> Result<usize> {
    v.as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("`{what}` is not a count"))
}

/// The prompts of an assistant record, or `None` for another kind of golden file.
fn read(path: &Path) -> Result<Option<(Vec<Prompt>, usize)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let Some(list) = json["prompts"].as_array() else {
        return Ok(None);
    };
    if list.iter().any(|p| p.get("clean_kv").is_none()) {
        return Ok(None);
    }
    let per_round = json["generation"]["num_assistant_tokens"]
        .as_u64()
        .map_or(4, |n| n as usize);
    let mut prompts = Vec::with_capacity(list.len());
    for p in list {
        let clean = &p["clean_kv"];
        let mut rounds = Vec::new();
        for r in clean["rounds"]
            .as_array()
            .context("`clean_kv.rounds` is missing")?
        {
            rounds.push(Round {
                number: r["round"].as_u64().context("a round has no number")?,
                seq_len: count(&r["seq_len"], "seq_len")?,
                drafts: ids(&r["draft_ids"], "draft_ids")?,
                accepted: count(&r["n_accepted"], "n_accepted")?,
            });
        }
        prompts.push(Prompt {
            name: p["name"].as_str().unwrap_or("?").to_string(),
            input_ids: ids(&p["input_ids"], "input_ids")?,
            generated: ids(&clean["generated_ids"], "clean_kv.generated_ids")?,
            rounds,
        });
    }
    Ok(Some((prompts, per_round)))
}

/// Checks `assistant_dir` for `target` against the record at `golden`;
/// prints a line per prompt and check, and returns whether all matched.
pub fn verify(
    target: Gemma4,
    tokenizer: Tokenizer,
    assistant_dir: &Path,
    policy: LoadPolicy,
    golden: &Path,
    tolerance: f32,
) -> Result<bool> {
    let Some((prompts, per_round)) = read(golden)? else {
        bail!(
            "{} is not a speculative-decoding record (prompts with `clean_kv` rounds); --draft-model checks only those",
            golden.display()
        );
    };
    let assistant = Assistant::load(assistant_dir, policy)
        .with_context(|| format!("cannot load the assistant {}", assistant_dir.display()))?;
    assistant.check_target(target.config())?;
    let tensors_path = golden.with_file_name("golden_tensors.safetensors");
    let tensors = match tensors_path.is_file() {
        true => Some(SafetensorsStore::open_files(&[tensors_path])?),
        false => None,
    };
    let mut all_match = true;
    for (i, p) in prompts.iter().enumerate() {
        all_match &= check_rounds(&target, &assistant, tensors.as_ref(), i, p, tolerance)?;
    }
    let k = per_round.clamp(1, gemma4_engine::speculative::MAX_SPECULATIVE_TOKENS);
    let executor = CpuExecutor::new(target)
        .with_assistant(assistant)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let longest = prompts
        .iter()
        .map(|p| p.input_ids.len() + p.generated.len())
        .max()
        .unwrap_or(1);
    let engine = gemma4_engine::start_with(
        Box::new(executor),
        Arc::new(tokenizer),
        EngineConfig {
            max_num_seqs: 1,
            max_model_len: longest + 1,
            prefix_caching: false,
            speculative: Some(SpeculativeConfig::assistant(k)?.unpaced()),
            ..EngineConfig::default()
        },
    )
    .context("cannot start the engine")?;
    for p in &prompts {
        let mut stream = engine.submit(GenerationRequest {
            prompt_ids: p.input_ids.clone(),
            params: SamplingParams {
                max_tokens: p.generated.len(),
                ..SamplingParams::default()
            },
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })?;
        let mut out = Vec::new();
        let mut counts = None;
        while let Some(event) = stream.blocking_next() {
            match event {
                EngineEvent::Token { id, .. } => out.push(id),
                EngineEvent::Finished { reason, usage, .. } => {
                    if let FinishReason::Error(e) = reason {
                        bail!("prompt {}: generation failed: {e}", p.name);
                    }
                    counts = Some(usage.speculation);
                    break;
                }
                EngineEvent::PromptLogprobs(_) => {}
            }
        }
        let counts = counts.unwrap_or_default();
        let drafted: usize = p.rounds.iter().map(|r| r.drafts.len()).sum();
        let accepted: usize = p.rounds.iter().map(|r| r.accepted).sum();
        let same = out == p.generated
            && counts.draft_tokens == drafted as u64
            && counts.accepted_tokens == accepted as u64;
        all_match &= same;
        println!(
            "{} prompt={} engine: tokens {}/{} as recorded, drafted {}, accepted {} (recorded {drafted}, {accepted})",
            if same { "MATCH" } else { "DIFF " },
            p.name,
            out.iter().zip(&p.generated).take_while(|(a, b)| a == b).count(),
            p.generated.len(),
            counts.draft_tokens,
            counts.accepted_tokens,
        );
    }
    Ok(all_match)
}

/// Drafts every recorded round of prompt `i` from scratch; prints one line
/// naming the first round that departs, if any.
fn check_rounds(
    target: &Gemma4,
    assistant: &Assistant,
    tensors: Option<&SafetensorsStore>,
    i: usize,
    p: &Prompt,
    tolerance: f32,
) -> Result<bool> {
    let sequence = [p.input_ids.as_slice(), &p.generated].concat();
    let mut worst = 0f32;
    let mut checked = 0;
    for r in p.rounds.iter().filter(|r| !r.drafts.is_empty()) {
        let tokens = sequence
            .get(..r.seq_len)
            .with_context(|| format!("round {} runs past the recorded tokens", r.number))?;
        let steps = assistant.draft_from_scratch(target, tokens, r.drafts.len())?;
        let drafted: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let mut diff = 0f32;
        if let Some(t) = tensors {
            let name = format!("prompt{i}.clean.round{}.draft_logits", r.number);
            let want = t.get(&name, &[r.drafts.len(), assistant.config().vocab_size])?;
            let want = want.flatten_all()?.to_vec1::<f32>()?;
            for (s, row) in steps.iter().zip(want.chunks(assistant.config().vocab_size)) {
                for (a, b) in s.logits.iter().zip(row) {
                    diff = diff.max((a - b).abs());
                }
            }
        }
        worst = worst.max(diff);
        if drafted != r.drafts || diff > tolerance {
            println!(
                "DIFF  prompt={} first departing round {} (position {}): drafted {drafted:?} where the reference drafted {:?}, max_abs_draft_logit_diff={diff:.3e}",
                p.name,
                r.number,
                r.seq_len - 1,
                r.drafts
            );
            return Ok(false);
        }
        checked += 1;
    }
    println!(
        "MATCH prompt={} rounds={checked} drafts=exact max_abs_draft_logit_diff={worst:.3e}{}",
        p.name,
        if tensors.is_none() {
            " (no golden_tensors.safetensors: ids only)"
        } else {
            ""
        }
    );
    Ok(true)
}
