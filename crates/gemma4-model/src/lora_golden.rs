//! The LoRA oracle's reference outputs (`golden.json` beside
//! `golden_tensors.safetensors`, made with PEFT over transformers in f32)
//! and the check of a model with an adapter against them: the logits of
//! every prompt position, then each greedy step's logits and token.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Tensor;
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::gemma4::{BatchSeq, Gemma4, LogitsFor};
use crate::golden::{argmax, nan_safe_diff, PromptReport};
use crate::lora::LoraAdapter;
use crate::safetensors_store::SafetensorsStore;
use crate::KvStore;

#[derive(Debug, Clone, Deserialize)]
pub struct LoraGolden {
    pub base: GoldenRun,
    pub adapters: Vec<GoldenAdapter>,
}

/// The base model's (or an adapter's) prompts.
#[derive(Debug, Clone, Deserialize)]
pub struct GoldenRun {
    pub prompts: Vec<LoraGoldenPrompt>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoldenAdapter {
    pub name: String,
    /// The bf16 adapter folder, relative to the golden file.
    pub folder: String,
    /// The same values in f32.
    pub folder_f32: String,
    /// Per module name (`q_proj`, …): the rank, alpha and scaling PEFT used.
    pub scaling_per_module: BTreeMap<String, ModuleScaling>,
    pub prompts: Vec<LoraGoldenPrompt>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct ModuleScaling {
    pub r: usize,
    pub alpha: f64,
    pub scaling: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LoraGoldenPrompt {
    pub name: String,
    pub input_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
}

impl LoraGolden {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ModelError::Input(format!("cannot read golden file {}: {e}", path.display()))
        })?;
        serde_json::from_str(&text).map_err(|e| {
            ModelError::Input(format!(
                "{} is not a golden file of the LoRA oracle: {e}",
                path.display()
            ))
        })
    }

    /// The adapter whose bf16 or f32 folder is `folder` (its last name, or
    /// a GGUF file named after it).
    pub fn adapter_for(&self, folder: &Path) -> Option<&GoldenAdapter> {
        // A GGUF file converted from a folder carries the folder's name.
        let last = match folder.extension() {
            Some(e) if e == "gguf" => folder.file_stem()?.to_str()?,
            _ => folder.file_name()?.to_str()?,
        };
        self.adapters
            .iter()
            .find(|a| a.folder == last || a.folder_f32 == last)
    }
}

/// The reference's logits for one run of the golden tensors file: every
/// prompt position, then the row each greedy token was picked from.
pub struct ReferenceLogits {
    store: SafetensorsStore,
}

impl ReferenceLogits {
    pub fn open(path: &Path) -> Result<Self> {
        Ok(Self {
            store: SafetensorsStore::open_files(&[path.to_path_buf()])?,
        })
    }

    /// `[rows, vocab]` of `{run}.prompt{index}.{what}` (`run` is `base` or
    /// an adapter's name, `what` `logits` or `greedy_step_logits`).
    pub fn rows(&self, run: &str, index: usize, what: &str) -> Result<Vec<Vec<f32>>> {
        let key = format!("{run}.prompt{index}.{what}");
        let shape = self
            .store
            .shape(&key)
            .ok_or_else(|| ModelError::Input(format!("the golden tensors have no `{key}`")))?
            .to_vec();
        Ok(self.store.get(&key, &shape)?.to_vec2::<f32>()?)
    }
}

/// Runs a golden prompt with `adapter` (or none): the prompt in chunks of
/// `chunk` tokens (the whole prompt at once with `None`), then greedy
/// cached decoding, every logit held to the reference's rows.
pub fn verify_lora_prompt(
    model: &Gemma4,
    adapter: Option<&LoraAdapter>,
    prompt: &LoraGoldenPrompt,
    reference: (&[Vec<f32>], &[Vec<f32>]),
    chunk: Option<usize>,
    tol: f32,
) -> Result<PromptReport> {
    let (prompt_rows, step_rows) = reference;
    let mut cache = model.new_cache();
    let ids = &prompt.input_ids;
    let mut rows = Vec::with_capacity(ids.len());
    for part in ids.chunks(chunk.unwrap_or(ids.len()).max(1)) {
        rows.extend(run(model, adapter, part, &mut cache, LogitsFor::All)?);
    }
    let mut max_diff = max_row_diff(&rows, prompt_rows)?;
    let steps = prompt.greedy_ids.len();
    let mut generated = Vec::with_capacity(steps);
    let mut first_token_mismatch = None;
    let mut logits = rows.pop().unwrap_or_default();
    for step in 0..steps {
        if let Some(gold) = step_rows.get(step) {
            max_diff = max_diff.max(max_row_diff(
                std::slice::from_ref(&logits),
                std::slice::from_ref(gold),
            )?);
        }
        let (arg, _) = argmax(&logits);
        if first_token_mismatch.is_none() && arg != prompt.greedy_ids[step] {
            first_token_mismatch = Some(step);
        }
        generated.push(arg);
        if step + 1 < steps {
            logits = run(model, adapter, &[arg], &mut cache, LogitsFor::Last)?
                .pop()
                .unwrap_or_default();
        }
    }
    Ok(PromptReport {
        name: prompt.name.clone(),
        seq_match: first_token_mismatch.is_none() && max_diff <= tol,
        generated_ids: generated,
        first_token_mismatch,
        max_abs_logit_diff: max_diff,
        top5_mismatches: Vec::new(),
    })
}

/// One step of one sequence with its adapter; the rows it asked for.
fn run(
    model: &Gemma4,
    adapter: Option<&LoraAdapter>,
    ids: &[u32],
    cache: &mut crate::KvCache,
    want: LogitsFor,
) -> Result<Vec<Vec<f32>>> {
    let seq = BatchSeq {
        ids,
        start: cache.len(),
        logits: Some(want),
        soft: None,
        lora: adapter,
    };
    let out = model.forward_batch(&[seq], cache as &mut dyn KvStore, None)?;
    cache.advance(ids.len());
    let logits: Tensor = out
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| ModelError::Input("no logits were produced".into()))?;
    Ok(logits.to_vec2::<f32>()?)
}

/// Largest |ours − reference| over rows of equal count and width
/// (NaN counts as infinitely far).
fn max_row_diff(ours: &[Vec<f32>], gold: &[Vec<f32>]) -> Result<f32> {
    if ours.len() != gold.len() {
        return Err(ModelError::Input(format!(
            "{} rows of logits against the reference's {}",
            ours.len(),
            gold.len()
        )));
    }
    let mut max = 0f32;
    for (a, b) in ours.iter().zip(gold) {
        if a.len() != b.len() {
            return Err(ModelError::Input(format!(
                "{} logits per row against the reference's {}",
                a.len(),
                b.len()
            )));
        }
        for (x, y) in a.iter().zip(b) {
            max = max.max(nan_safe_diff(*x, *y));
        }
    }
    Ok(max)
}
