//! `gemma4 verify`: our logits and greedy tokens against a reference golden file.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use gemma4_model::golden::{greedy, locate_divergence, verify_prompt, Golden, DEFAULT_TOLERANCE};

use crate::model_io::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Golden file in the oracle format (prompts with logits and greedy ids),
    /// or one with images (checked stage by stage: processor, encoder, prompts).
    #[arg(long)]
    golden: PathBuf,
    /// Maximum allowed absolute logit difference.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE)]
    tolerance: f32,
    /// A llama.cpp multimodal projector file (`mmproj` GGUF: Gemma 4's vision
    /// and audio towers) to read images and audio with; it replaces any
    /// towers of the checkpoint.
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// The model's assistant (MTP drafter) checkpoint, checked against a
    /// speculative-decoding record (`--golden` with `clean_kv` rounds) round
    /// by round.
    #[arg(long, value_name = "DIR")]
    draft_model: Option<PathBuf>,
    /// A LoRA adapter (PEFT folder or GGUF LoRA file) to check against a golden file of the
    /// LoRA oracle (its run for that adapter; without it, the base run).
    #[arg(long, value_name = "PATH")]
    lora: Option<PathBuf>,
}

/// A golden file with images and audio, or with a video.
enum MediaGolden {
    Vision(crate::verify_vision::VisionGolden),
    Video(crate::verify_video::VideoGolden),
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = args.model.path()?;
    if let Some(dir) = &args.draft_model {
        let (model, _) = crate::model_io::load_model(&path, args.model.policy())?;
        let tokenizer = crate::model_io::load_tokenizer(&path)?;
        let policy = args.model.policy();
        let all_match = crate::verify_assistant::verify(
            model,
            tokenizer,
            dir,
            policy,
            &args.golden,
            args.tolerance,
        )?;
        println!("SEQ_MATCH {all_match}");
        return Ok(if all_match {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if let Some(golden) = crate::verify_lora::read(&args.golden)? {
        let (model, _) = crate::model_io::load_model(&path, args.model.policy())?;
        let tokenizer = crate::model_io::load_tokenizer(&path).ok();
        let all_match = crate::verify_lora::verify(
            &model,
            tokenizer.as_ref(),
            &args.golden,
            &golden,
            args.lora.as_deref(),
            args.tolerance,
        )?;
        return Ok(if all_match {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if args.lora.is_some() {
        anyhow::bail!(
            "--lora is checked against a golden file of the LoRA oracle (with `base` and `adapters`); {} is not one",
            args.golden.display()
        );
    }
    // Golden files with media are checked stage by stage.
    let media = match crate::verify_vision::VisionGolden::read(&args.golden)? {
        Some(g) => Some(MediaGolden::Vision(g)),
        None => crate::verify_video::VideoGolden::read(&args.golden)?.map(MediaGolden::Video),
    };
    if let Some(golden) = media {
        let (model, _) = crate::model_io::load_model(&path, args.model.policy())?;
        let towers = (path.as_path(), args.mmproj.as_deref());
        let all_match = match &golden {
            MediaGolden::Vision(g) => {
                crate::verify_vision::verify(&model, towers, &args.golden, g, args.tolerance)?
            }
            MediaGolden::Video(g) => {
                crate::verify_video::verify(&model, towers, &args.golden, g, args.tolerance)?
            }
        };
        println!("SEQ_MATCH {all_match}");
        return Ok(if all_match {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let golden = Golden::read(&args.golden)?;
    let (model, _) = crate::model_io::load_model(&path, args.model.policy())?;
    let tokenizer = crate::model_io::load_tokenizer(&path).ok();
    let tensors = args.golden.with_file_name("golden_tensors.safetensors");
    let mut all_match = true;
    let mut worst = 0f32;
    for (i, p) in golden.prompts.iter().enumerate() {
        let r = verify_prompt(&model, p, args.tolerance)?;
        worst = worst.max(r.max_abs_logit_diff);
        all_match &= r.seq_match;
        let total = p.greedy.generated_ids.len();
        let same = r.first_token_mismatch.unwrap_or(total);
        let text = tokenizer
            .as_ref()
            .and_then(|t| t.decode(&r.generated_ids, false).ok())
            .map(|s| format!(" text={s:?}"))
            .unwrap_or_default();
        println!(
            "{} prompt={} tokens={} greedy={same}/{total} top5_mismatches={} max_abs_logit_diff={:.3e}{text}",
            if r.seq_match { "MATCH" } else { "DIFF " },
            p.name,
            p.input_ids.len(),
            r.top5_mismatches.len(),
            r.max_abs_logit_diff,
        );
        if !r.seq_match && tensors.is_file() {
            let d = locate_divergence(&model, &tensors, i, &p.input_ids)?;
            println!("  diagnosis: {}", d.describe(model.config().num_layers()));
        }
    }
    // Prompts whose reference answer is known to be sensible language.
    for c in golden.coherence.iter().flat_map(|c| &c.prompts) {
        let ids = greedy(&model, &c.input_ids, c.generated_ids.len())?;
        let same = ids == c.generated_ids;
        all_match &= same;
        let text = tokenizer
            .as_ref()
            .and_then(|t| t.decode(&ids, false).ok())
            .unwrap_or_default();
        println!(
            "{} coherence prompt={:?} text={text:?} reference={:?}",
            if same { "MATCH" } else { "DIFF " },
            c.text,
            c.generated_text
        );
    }
    println!("SEQ_MATCH {all_match} max_abs_logit_diff={worst:.3e}");
    Ok(if all_match {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
