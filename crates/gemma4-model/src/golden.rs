//! Reference ("golden") outputs and the comparison against them.
//!
//! A golden file lists prompts with the reference's logits, top-5 ids at
//! every position and a 24-token greedy continuation (EOS stopping off).
//! [`verify_prompt`] runs a prompt the way the server does (one prefill,
//! then cached one-token decode steps) and reports every disagreement.
//! [`locate_divergence`] uses `golden_tensors.safetensors` to name the first
//! layer whose hidden state departs from the reference.

use std::path::Path;

use candle_core::{DType, Tensor};
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::gemma4::{ForwardTrace, Gemma4, LogitsFor};
use crate::safetensors_store::SafetensorsStore;

/// The reference's logit tolerance for f32 compute (see the oracle README).
pub const DEFAULT_TOLERANCE: f32 = 1e-3;
/// Relative tolerance on hidden states when locating a divergence.
pub const HIDDEN_RELATIVE_TOLERANCE: f32 = 1e-4;

#[derive(Debug, Clone, Deserialize)]
pub struct Golden {
    pub prompts: Vec<GoldenPrompt>,
    /// Prompts whose reference continuation must also make sense as language.
    #[serde(default)]
    pub coherence: Option<Coherence>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Coherence {
    pub prompts: Vec<CoherencePrompt>,
}

/// A prompt, its reference greedy ids and the decoded reference text.
#[derive(Debug, Clone, Deserialize)]
pub struct CoherencePrompt {
    pub text: String,
    pub input_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub generated_text: String,
}

/// The real-weights demo GGUF the tests use: `GEMMA4_DEMO_GGUF`, or `None`
/// (the test is skipped, with a line saying so) outside CI; under CI
/// (`CI` set) a missing variable is a failure.
pub fn demo_gguf_for_tests() -> Option<std::path::PathBuf> {
    match std::env::var_os("GEMMA4_DEMO_GGUF") {
        Some(p) => Some(std::path::PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => panic!("CI must set GEMMA4_DEMO_GGUF"),
        None => {
            eprintln!("skipped: set GEMMA4_DEMO_GGUF to the Gemma 3 270M GGUF");
            None
        }
    }
}

/// Greedy decoding of `prompt` for `steps` tokens (no early stop).
pub fn greedy(model: &Gemma4, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
    Ok(greedy_with_soft_tokens(model, prompt, None, steps)?.1)
}

/// [`greedy`] for a prompt some of whose rows come from an encoder; also
/// returns the logits at the last prompt position.
pub fn greedy_with_soft_tokens(
    model: &Gemma4,
    prompt: &[u32],
    soft: Option<crate::SoftTokens<'_>>,
    steps: usize,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let mut cache = model.new_cache();
    let first = model
        .forward_with_soft_tokens(prompt, soft, &mut cache, LogitsFor::Last, None)?
        .squeeze(0)?
        .to_vec1::<f32>()?;
    let mut row = first.clone();
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let (next, _) = argmax(&row);
        out.push(next);
        if step + 1 < steps {
            row = model
                .forward(&[next], &mut cache, LogitsFor::Last, None)?
                .squeeze(0)?
                .to_vec1::<f32>()?;
        }
    }
    Ok((first, out))
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoldenPrompt {
    #[serde(alias = "prompt")]
    pub name: String,
    pub input_ids: Vec<u32>,
    #[serde(default)]
    pub last_logits: Option<Vec<f32>>,
    #[serde(default)]
    pub last_position_top20_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub last_position_top20_logits: Option<Vec<f32>>,
    #[serde(alias = "top5_ids_every_position")]
    pub top5_ids: Vec<Vec<u32>>,
    #[serde(default)]
    pub top5_logits: Option<Vec<Vec<f32>>>,
    pub greedy: GoldenGreedy,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoldenGreedy {
    pub generated_ids: Vec<u32>,
    #[serde(default)]
    pub step_max_logit: Option<Vec<f32>>,
}

impl Golden {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ModelError::Input(format!("cannot read golden file {}: {e}", path.display()))
        })?;
        serde_json::from_str(&text).map_err(|e| {
            ModelError::Input(format!(
                "{} is not a golden file in the oracle format: {e}",
                path.display()
            ))
        })
    }
}

/// The outcome of one prompt.
#[derive(Debug, Clone)]
pub struct PromptReport {
    pub name: String,
    /// Greedy ids identical and every logit check within tolerance.
    pub seq_match: bool,
    pub generated_ids: Vec<u32>,
    /// Index of the first greedy step that differs, if any.
    pub first_token_mismatch: Option<usize>,
    /// Largest |ours − reference| over every logit the golden file records.
    pub max_abs_logit_diff: f32,
    /// Prompt positions whose top-5 ids disagree beyond near-ties.
    pub top5_mismatches: Vec<usize>,
}

/// Runs one golden prompt: a single prefill, then greedy cached decoding.
pub fn verify_prompt(model: &Gemma4, p: &GoldenPrompt, tol: f32) -> Result<PromptReport> {
    let mut cache = model.new_cache();
    let all = model.forward(&p.input_ids, &mut cache, LogitsFor::All, None)?;
    let rows = all.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut max_diff = 0f32;
    let mut top5_mismatches = Vec::new();
    if p.top5_ids.len() != rows.len() {
        return Err(ModelError::Input(format!(
            "golden prompt `{}` has top-5 ids for {} positions but {} input ids",
            p.name,
            p.top5_ids.len(),
            rows.len()
        )));
    }
    for (pos, (row, gold)) in rows.iter().zip(&p.top5_ids).enumerate() {
        let gold_logits = p.top5_logits.as_ref().and_then(|l| l.get(pos));
        let (ok, diff) = compare_top(row, gold, gold_logits.map(Vec::as_slice), tol);
        max_diff = max_diff.max(diff);
        if !ok {
            top5_mismatches.push(pos);
        }
    }
    let last = rows.last().cloned().unwrap_or_default();
    if let Some(gold) = &p.last_logits {
        if gold.len() != last.len() {
            return Err(ModelError::Input(format!(
                "golden prompt `{}` has {} last logits but the model's vocabulary is {}",
                p.name,
                gold.len(),
                last.len()
            )));
        }
        for (a, b) in last.iter().zip(gold) {
            max_diff = max_diff.max((a - b).abs());
        }
    }
    if let (Some(ids), Some(logits)) = (&p.last_position_top20_ids, &p.last_position_top20_logits) {
        for (&id, &g) in ids.iter().zip(logits) {
            let ours = last.get(id as usize).copied().unwrap_or(f32::NAN);
            max_diff = max_diff.max(nan_safe_diff(ours, g));
        }
    }
    // Greedy: step 0 from the prefill, then one token at a time through the cache.
    let steps = p.greedy.generated_ids.len();
    let mut generated = Vec::with_capacity(steps);
    let mut first_token_mismatch = None;
    let mut logits = last;
    for step in 0..steps {
        let (arg, max) = argmax(&logits);
        if let Some(gmax) = p.greedy.step_max_logit.as_ref().and_then(|v| v.get(step)) {
            max_diff = max_diff.max(nan_safe_diff(max, *gmax));
        }
        if first_token_mismatch.is_none() && arg != p.greedy.generated_ids[step] {
            first_token_mismatch = Some(step);
        }
        generated.push(arg);
        if step + 1 < steps {
            let next = model.forward(&[arg], &mut cache, LogitsFor::Last, None)?;
            logits = next.to_dtype(DType::F32)?.squeeze(0)?.to_vec1::<f32>()?;
        }
    }
    let seq_match = first_token_mismatch.is_none() && top5_mismatches.is_empty() && max_diff <= tol;
    Ok(PromptReport {
        name: p.name.clone(),
        seq_match,
        generated_ids: generated,
        first_token_mismatch,
        max_abs_logit_diff: max_diff,
        top5_mismatches,
    })
}

pub(crate) fn nan_safe_diff(a: f32, b: f32) -> f32 {
    let d = (a - b).abs();
    if d.is_nan() {
        f32::INFINITY
    } else {
        d
    }
}

/// Index and value of the largest logit (first on ties).
pub fn argmax(row: &[f32]) -> (u32, f32) {
    let mut best = (0u32, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i as u32, v);
        }
    }
    best
}

/// Our top ids against the reference's: equal rank by rank, except where our
/// own logits for the two ids are within `tol` (a near-tie). When reference
/// logits are given, our logit for each reference id must be within `tol`.
fn compare_top(row: &[f32], gold: &[u32], gold_logits: Option<&[f32]>, tol: f32) -> (bool, f32) {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    let mut ok = true;
    let mut max_diff = 0f32;
    for (rank, &g) in gold.iter().enumerate() {
        let ours = order.get(rank).copied().unwrap_or(usize::MAX);
        let g_ours = row.get(g as usize).copied().unwrap_or(f32::NAN);
        if ours != g as usize {
            let tie = row.get(ours).is_some_and(|&o| (o - g_ours).abs() < tol);
            ok &= tie;
        }
        if let Some(gl) = gold_logits.and_then(|l| l.get(rank)) {
            max_diff = max_diff.max(nan_safe_diff(g_ours, *gl));
        }
    }
    (ok, max_diff)
}

/// Where a prompt's computation first departs from the reference.
#[derive(Debug, Clone)]
pub struct Divergence {
    /// Index into the reference's hidden-state list: 0 = embedding output,
    /// `j` = output of decoder layer `j − 1`, `L + 1` = final norm.
    pub hidden_index: Option<usize>,
    pub relative_error: f32,
    /// MoE: `(layer, token position, ours, reference)` of the first routing difference.
    pub routing: Option<(usize, usize, Vec<usize>, Vec<usize>)>,
}

impl Divergence {
    /// A sentence naming the first departing layer.
    pub fn describe(&self, num_layers: usize) -> String {
        let mut s = match self.hidden_index {
            None => "all hidden states match the reference".to_string(),
            Some(0) => format!(
                "the embedding output already differs (relative error {:.2e})",
                self.relative_error
            ),
            Some(j) if j <= num_layers => format!(
                "first departure at decoder layer {} output (relative error {:.2e})",
                j - 1,
                self.relative_error
            ),
            Some(_) => format!(
                "first departure at the final norm (relative error {:.2e})",
                self.relative_error
            ),
        };
        if let Some((layer, pos, ours, gold)) = &self.routing {
            s.push_str(&format!(
                "; first routing difference at layer {layer}, position {pos}: experts {ours:?}, reference {gold:?}"
            ));
        }
        s
    }
}

/// Compares per-layer hidden states (and MoE routing) of golden prompt
/// `index` with `golden_tensors.safetensors`.
pub fn locate_divergence(
    model: &Gemma4,
    tensors: &Path,
    index: usize,
    ids: &[u32],
) -> Result<Divergence> {
    let store = SafetensorsStore::open_files(&[tensors.to_path_buf()])?;
    let key = format!("prompt{index}.hidden_states");
    let shape = store
        .shape(&key)
        .ok_or_else(|| ModelError::Input(format!("{} has no `{key}`", tensors.display())))?
        .to_vec();
    let reference = store.get(&key, &shape)?;
    let mut trace = ForwardTrace::default();
    let mut cache = model.new_cache();
    model.forward(ids, &mut cache, LogitsFor::All, Some(&mut trace))?;
    let mut divergence = Divergence {
        hidden_index: None,
        relative_error: 0.0,
        routing: None,
    };
    for (j, ours) in trace.hidden.iter().enumerate().take(shape[0]) {
        let gold = reference.get(j)?;
        let scale = gold
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?
            .max(f32::MIN_POSITIVE);
        let err = (ours - &gold)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        if err > HIDDEN_RELATIVE_TOLERANCE || err.is_nan() {
            divergence.hidden_index = Some(j);
            divergence.relative_error = err;
            break;
        }
    }
    let rkey = format!("prompt{index}.router_top_k_index");
    if let Some(rshape) = store.shape(&rkey).map(<[usize]>::to_vec) {
        let gold = store_i64(&store, &rkey, &rshape)?;
        'outer: for (layer, ours) in trace.routing.iter().enumerate() {
            for (pos, ours_t) in ours.iter().enumerate() {
                let g: Vec<usize> = gold
                    .get(layer)
                    .and_then(|l| l.get(pos))
                    .cloned()
                    .unwrap_or_default();
                if *ours_t != g {
                    divergence.routing = Some((layer, pos, ours_t.clone(), g));
                    break 'outer;
                }
            }
        }
    }
    Ok(divergence)
}

/// Reads an int64 `[L, n, k]` tensor as nested vectors.
fn store_i64(store: &SafetensorsStore, key: &str, shape: &[usize]) -> Result<Vec<Vec<Vec<usize>>>> {
    let t: Tensor = store.get_raw(key, shape)?;
    let flat = t.flatten_all()?.to_vec1::<i64>()?;
    let (l, n, k) = (shape[0], shape[1], shape[2]);
    Ok((0..l)
        .map(|a| {
            (0..n)
                .map(|b| {
                    (0..k)
                        .map(|c| flat[(a * n + b) * k + c].max(0) as usize)
                        .collect()
                })
                .collect()
        })
        .collect())
}
