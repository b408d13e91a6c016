//! `gemma4 verify` with a golden file of the LoRA oracle: the base model,
//! or the model with `--lora` (one of the golden's adapters), against the
//! reference's logits at every prompt position and greedy step.

use std::path::Path;

use anyhow::{bail, Context, Result};
use gemma4_model::lora_golden::{verify_lora_prompt, LoraGolden, ReferenceLogits};
use gemma4_model::{Gemma4, LoraAdapter};
use gemma4_text::Tokenizer;

/// The golden file, if it is one of the LoRA oracle's.
pub fn read(golden: &Path) -> Result<Option<LoraGolden>> {
    let text = std::fs::read_to_string(golden)
        .with_context(|| format!("cannot read golden file {}", golden.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", golden.display()))?;
    if json.get("base").is_none() || json.get("adapters").is_none() {
        return Ok(None);
    }
    Ok(Some(LoraGolden::read(golden)?))
}

/// Checks every prompt of the run `lora` selects (the base model's
/// without it); true when every token and logit matches.
pub fn verify(
    model: &Gemma4,
    tokenizer: Option<&Tokenizer>,
    golden_path: &Path,
    golden: &LoraGolden,
    lora: Option<&Path>,
    tolerance: f32,
) -> Result<bool> {
    let (run, prompts, adapter) = match lora {
        None => ("base".to_string(), &golden.base.prompts, None),
        Some(dir) => {
            let Some(entry) = golden.adapter_for(dir) else {
                let known: Vec<&str> = golden.adapters.iter().map(|a| a.folder.as_str()).collect();
                bail!(
                    "{} has no run for the adapter {}; its adapters are {}",
                    golden_path.display(),
                    dir.display(),
                    known.join(", ")
                );
            };
            let adapter = LoraAdapter::load(&entry.name, dir, model.config())
                .with_context(|| format!("cannot load the LoRA adapter {}", dir.display()))?;
            (entry.name.clone(), &entry.prompts, Some(adapter))
        }
    };
    let reference =
        ReferenceLogits::open(&golden_path.with_file_name("golden_tensors.safetensors"))?;
    let mut all_match = true;
    let mut worst = 0f32;
    for (i, p) in prompts.iter().enumerate() {
        let rows = reference.rows(&run, i, "logits")?;
        let steps = reference.rows(&run, i, "greedy_step_logits")?;
        let r = verify_lora_prompt(model, adapter.as_ref(), p, (&rows, &steps), None, tolerance)?;
        worst = worst.max(r.max_abs_logit_diff);
        all_match &= r.seq_match;
        let total = p.greedy_ids.len();
        let same = r.first_token_mismatch.unwrap_or(total);
        let text = tokenizer
            .and_then(|t| t.decode(&r.generated_ids, false).ok())
            .map(|s| format!(" text={s:?}"))
            .unwrap_or_default();
        println!(
            "{} run={run} prompt={} tokens={} greedy={same}/{total} max_abs_logit_diff={:.3e}{text}",
            if r.seq_match { "MATCH" } else { "DIFF " },
            p.name,
            p.input_ids.len(),
            r.max_abs_logit_diff,
        );
    }
    println!("SEQ_MATCH {all_match} max_abs_logit_diff={worst:.3e}");
    Ok(all_match)
}
