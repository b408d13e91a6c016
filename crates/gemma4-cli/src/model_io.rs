//! Finding and opening a model: a checkpoint directory, a GGUF file, or the
//! demo model when no `--model` is given.

use std::path::{Path, PathBuf};

use std::io::IsTerminal;

use anyhow::{Context, Result};
use gemma4_model::{Gemma4, LoadPolicy, LoadReport, Quant};
use gemma4_text::{ChatTemplate, Tokenizer};

use crate::demo;

/// Model options shared by every command that runs a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json + safetensors) or GGUF file.
    /// Defaults to the demo model (see `gemma4 fetch-demo`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// f32 activations against quantized weights (GGUF blocks, `--quant`
    /// layouts): exact against the widened weights, and slower than the
    /// default integer kernels, which round activations to 8 bits per block.
    /// Float weights are exact either way.
    #[arg(long)]
    pub exact: bool,
    /// Quantize matrices stored as floats (safetensors, f16/bf16 GGUF) on
    /// load: `int8` (per output channel), `q4` (4-bit groups of 32 on the
    /// Q4_0 grid; `q4_0` is the same), or `none` (keep them as stored).
    #[arg(long, default_value = "none", value_parser = parse_quant)]
    pub quant: Quant,
    /// Jinja chat template to use instead of (or in the absence of) the checkpoint's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
}

/// The checkpoint's media encoders: the image encoder (vision tower, or the
/// 12B's encoder-free embedder) and the audio encoder (the E2B/E4B conformer
/// tower, or the 12B's frame embedder), where it has them, or those of the
/// `mmproj` file when one is named; loaded as stored (their matrices are
/// small beside the text model's, and quantizing them is not measured). A
/// GGUF text model carries none: its towers come in an `mmproj` file.
pub fn load_media_encoders(
    path: &Path,
    mmproj: Option<&Path>,
    text_hidden: usize,
) -> Result<(
    Option<gemma4_model::ImageEncoder>,
    Option<gemma4_model::AudioEncoder>,
)> {
    let (images, audio) = load_media_encoders_measured(path, mmproj, text_hidden)?;
    Ok((images.map(|(e, _)| e), audio.map(|(e, _)| e)))
}

/// An encoder with what its load kept resident.
pub type Measured<E> = Option<(E, gemma4_model::LoadReport)>;

/// [`load_media_encoders`], with what each load kept resident.
pub fn load_media_encoders_measured(
    path: &Path,
    mmproj: Option<&Path>,
    text_hidden: usize,
) -> Result<(
    Measured<gemma4_model::ImageEncoder>,
    Measured<gemma4_model::AudioEncoder>,
)> {
    if let Some(file) = mmproj {
        let context = || format!("cannot load the multimodal projector {}", file.display());
        // Media token ids from the checkpoint's config.json, else Gemma 4's.
        let text_config = if path.is_dir() {
            gemma4_model::read_config(path).with_context(context)?
        } else {
            serde_json::json!({})
        };
        let images = gemma4_model::ImageEncoder::load_mmproj(file, text_hidden, &text_config)
            .with_context(context)?;
        let audio = gemma4_model::AudioEncoder::load_mmproj(file, text_hidden, &text_config)
            .with_context(context)?;
        if images.is_none() && audio.is_none() {
            anyhow::bail!(
                "{} holds neither a vision nor an audio tower",
                file.display()
            );
        }
        return Ok((images, audio));
    }
    if !path.is_dir() {
        return Ok((None, None));
    }
    let context = || format!("cannot load the media encoders of {}", path.display());
    let images =
        gemma4_model::ImageEncoder::load_dir_measured(path, text_hidden).with_context(context)?;
    if let Some((encoder, _)) = &images {
        gemma4_media::ProcessorSettings::read(path)
            .and_then(|s| s.check_encoder(encoder.patch_geometry()))
            .map_err(anyhow::Error::msg)
            .with_context(context)?;
    }
    let audio =
        gemma4_model::AudioEncoder::load_dir_measured(path, text_hidden).with_context(context)?;
    Ok((images, audio))
}

/// A model with its tokenizer.
pub struct Loaded {
    pub path: PathBuf,
    pub model: Gemma4,
    pub tokenizer: Tokenizer,
}

fn parse_quant(s: &str) -> std::result::Result<Quant, String> {
    s.parse()
}

impl ModelArgs {
    /// The model path: `--model`, or the installed demo model.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => demo::installed_path(),
        }
    }

    pub fn policy(&self) -> LoadPolicy {
        LoadPolicy {
            quant: self.quant,
            exact: self.exact,
            measure_only: false,
        }
    }

    /// Loads the model (a progress bar on a terminal, else one summary line
    /// on stderr) and its tokenizer.
    pub fn load(&self) -> Result<Loaded> {
        let path = self.path()?;
        // The tokenizer first: its parse needs several times its final size
        // for a moment, and that memory is back before the weights arrive.
        let tokenizer = load_tokenizer(&path)?;
        release_freed_memory();
        let (model, _) = load_model(&path, self.policy())?;
        release_freed_memory();
        Ok(Loaded {
            path,
            model,
            tokenizer,
        })
    }

    /// The chat template: `--chat-template FILE`, else the checkpoint's own.
    /// A checkpoint without one is an error that names the fix.
    pub fn template(&self, tokenizer: &Tokenizer) -> Result<ChatTemplate> {
        let override_source = match &self.chat_template {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read chat template {}", p.display()))?,
            ),
            None => None,
        };
        Ok(ChatTemplate::for_tokenizer(
            tokenizer,
            override_source.as_deref(),
        )?)
    }
}

/// Loads a model with load progress on stderr and a one-line summary.
pub fn load_model(path: &Path, policy: LoadPolicy) -> Result<(Gemma4, LoadReport)> {
    let started = std::time::Instant::now();
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "loading {bar:30} {binary_bytes}/{binary_total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let first_tensor = std::cell::Cell::new(true);
    let progress = |done: u64, total: u64| {
        // By the first tensor the loader has dropped the GGUF's parsed
        // vocabulary: hand that memory back before the weight copies grow
        // the resident set (without it the demo's peak is ~35 MiB higher).
        if first_tensor.replace(false) {
            release_freed_memory();
        }
        if let Some(b) = &bar {
            b.set_length(total.max(done));
            b.set_position(done);
        }
    };
    let loaded = gemma4_model::load_with(path, policy, Some(&progress))
        .with_context(|| format!("cannot load model from {}", path.display()))?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let r = &loaded.report;
    let mut line = format!(
        "loaded {} in {:.1}s: weights {} (quantization: {}); resident ≈ {:.0} MiB, mapped tables {:.0} MiB read by row; kernels: {}",
        path.display(),
        started.elapsed().as_secs_f64(),
        r.storage_summary(),
        policy.quant.name(),
        r.resident_bytes as f64 / (1 << 20) as f64,
        r.table_bytes as f64 / (1 << 20) as f64,
        gemma4_kernels::describe(),
    );
    if policy.quant == Quant::Q4 && r.q4_grid_detected() {
        line.push_str("; the weights were already on a Q4_0 grid (quantization-aware training): quantized without changing their levels");
    }
    eprintln!("{line}");
    Ok((loaded.model, loaded.report))
}

/// Hands memory freed during loading back to the system. Building a
/// 262k-entry tokenizer leaves tens of MiB of freed temporaries that the
/// allocator would otherwise keep for the life of the process.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The tokenizer of a checkpoint directory or GGUF file.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let gguf = gemma4_model::gguf_file(path)?;
    let tok = match &gguf {
        Some(file) => Tokenizer::from_gguf(file),
        None => Tokenizer::from_dir(path),
    };
    tok.with_context(|| format!("cannot load the tokenizer of {}", path.display()))
}
