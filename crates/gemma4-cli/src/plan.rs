//! `gemma4 plan`: memory plan from the configuration alone.

use crate::lora::LoraArgs;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use gemma4_model::config::{AttentionKind, TextConfig};
use gemma4_model::paged::KvDtype;
use gemma4_model::plan::{
    kv_bytes_for_context, kv_bytes_per_token, param_counts, resident_estimate, tokens_that_fit,
};
use gemma4_model::{LoadPolicy, Quant};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (only config.json is read) or GGUF file. Defaults to the demo model.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Context length to plan for (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Memory per device, e.g. 16GiB, 24G, 512MiB.
    #[arg(long)]
    mem: Option<String>,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Quantization of float weights on load: none (as published, bf16), int8 or q4.
    #[arg(long, default_value = "none", value_parser = |s: &str| s.parse::<Quant>())]
    quant: Quant,
    /// Sequences served at once (the KV pools of the resident-memory prediction).
    #[arg(long, default_value_t = 1)]
    max_num_seqs: usize,
    /// Print the resident-memory prediction as JSON instead of the tables.
    #[arg(long)]
    json: bool,
    /// A llama.cpp multimodal projector file whose towers `serve --mmproj`
    /// would load beside the model (counted in the resident prediction).
    #[arg(long)]
    mmproj: Option<std::path::PathBuf>,
    /// KV-cache element type: bf16, f32 or int8 [default: bf16 for the tables (the
    /// published figures), f32 (what `serve` uses by default) for the resident prediction].
    #[arg(long, value_parser = |s: &str| s.parse::<KvDtype>())]
    kv_dtype: Option<KvDtype>,
    /// LoRA adapters `serve --lora` would load (read and checked against
    /// the model, counted in the resident prediction).
    #[command(flatten)]
    lora: LoraArgs,
}

/// Parses `16GiB`, `24G`, `512MiB`, `1e9`, or plain bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("`{s}` is not a size like 16GiB or 512MiB"))?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        other => bail!("unknown size unit `{other}` in `{s}` (use B, KiB, MiB, GiB, KB, MB, GB)"),
    };
    if !(n.is_finite() && n >= 0.0) {
        bail!("`{s}` is not a non-negative size");
    }
    Ok((n * mult) as u64)
}

fn human(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2} {}", units[i])
}

fn config_of(path: &Path) -> Result<TextConfig> {
    match gemma4_model::gguf_file(path)? {
        Some(file) => Ok(gemma4_model::GgufSource::open(&file)?.config()?),
        None => Ok(TextConfig::from_dir(path)?),
    }
}

/// The resident-memory prediction for this checkpoint's own weights, if it
/// has any (a directory with only `config.json` has none). The weights are
/// mapped, not read: the load as stored only measures them.
fn resident_of_load(
    path: &Path,
    cfg: &TextConfig,
    args: &Args,
    ctx: usize,
) -> Result<Option<gemma4_model::plan::ResidentEstimate>> {
    let has_weights = gemma4_model::gguf_file(path)?.is_some()
        || path.join("model.safetensors").is_file()
        || path.join("model.safetensors.index.json").is_file();
    if !has_weights {
        return Ok(None);
    }
    let measure = LoadPolicy {
        measure_only: true,
        ..LoadPolicy::default()
    };
    let loaded = gemma4_model::load_with(path, measure, None)
        .with_context(|| format!("cannot measure the weights of {}", path.display()))?;
    let weights = loaded.report.projected_weights(args.quant);
    let mut estimate = resident_estimate(
        cfg,
        weights,
        ctx,
        args.max_num_seqs,
        512,
        args.kv_dtype.unwrap_or(KvDtype::F32),
    );
    // The towers load as stored whatever --quant asks (as `serve` loads them,
    // from the checkpoint or from --mmproj).
    let (images, audio) = crate::model_io::load_media_encoders_measured(
        path,
        args.mmproj.as_deref(),
        cfg.hidden_size,
    )?;
    estimate.media =
        images.map_or(0, |(_, r)| r.resident_bytes) + audio.map_or(0, |(_, r)| r.resident_bytes);
    estimate.adapters = args
        .lora
        .load(cfg, None)?
        .iter()
        .map(|a| a.bytes() as u64)
        .sum();
    Ok(Some(estimate))
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::demo::installed_path()?,
    };
    let cfg = config_of(&path)
        .with_context(|| format!("cannot read the configuration of {}", path.display()))?;
    if args.tp == 0 {
        bail!("--tp must be at least 1");
    }
    // Bytes per parameter: bf16 as published, or the quantized layout.
    let wbytes = match args.quant {
        Quant::AsStored => 2.0,
        Quant::Int8 => 1.0,
        Quant::Q4 => 20.0 / 32.0,
    };
    let kv = args.kv_dtype.unwrap_or(KvDtype::Bf16);
    let kv_name = kv.name();
    let ctx = args.max_model_len.unwrap_or(cfg.max_position_embeddings);
    let tp = args.tp as u64;
    let p = param_counts(&cfg);
    let resident = resident_of_load(&path, &cfg, &args, ctx)?;
    let kv_shown = args.kv_dtype.unwrap_or(KvDtype::F32).name();
    if args.json {
        let json = match resident {
            Some(r) => serde_json::json!({
                "predicted_resident_bytes": r.total(),
                "weights_bytes": r.weights,
                "kv_bytes": r.kv,
                "runtime_bytes": r.runtime,
                "media_encoders_bytes": r.media,
                "lora_adapters_bytes": r.adapters,
                "max_model_len": ctx,
                "max_num_seqs": args.max_num_seqs,
                "quant": args.quant.name(),
            }),
            None => {
                serde_json::json!({"predicted_resident_bytes": null, "reason": "no weights to measure"})
            }
        };
        println!("{json}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "model: {} ({}), {} layers, hidden {}, vocab {}",
        path.display(),
        cfg.model_type,
        cfg.num_layers(),
        cfg.hidden_size,
        cfg.vocab_size
    );
    println!(
        "weights ({}, per rank with --tp {}):",
        match args.quant {
            Quant::AsStored => "bf16 as published",
            q => q.name(),
        },
        args.tp
    );
    let rows = [
        ("embedding", p.embedding, true),
        ("per-layer embeddings", p.ple, true),
        ("attention", p.attention, true),
        ("mlp", p.mlp, true),
        ("experts", p.experts, true),
        ("norms and scalars", p.norms, false),
    ];
    let mut weights_per_rank = 0u64;
    for (name, n, sharded) in rows {
        if n == 0 {
            continue;
        }
        let per_rank = if sharded { n.div_ceil(tp) } else { n };
        let bytes = (per_rank as f64 * wbytes) as u64;
        weights_per_rank += bytes;
        println!(
            "  {name:<22} {:>8.3} B params  {:>12}",
            n as f64 / 1e9,
            human(bytes as f64)
        );
    }
    println!(
        "  {:<22} {:>8.3} B params  {:>12}",
        "total",
        p.total() as f64 / 1e9,
        human(weights_per_rank as f64)
    );
    println!("KV cache ({kv_name}):");
    let groups = kv_bytes_per_token(&cfg, kv);
    let mut per_token_rank = 0usize;
    for (g, bytes) in &groups {
        let kind = match g.kind {
            AttentionKind::Sliding => format!("sliding (window {})", cfg.sliding_window),
            AttentionKind::Full => "full".to_string(),
        };
        // Heads are split across ranks; a rank holds at least one KV head of each layer.
        let rank_bytes: usize = g
            .layers
            .iter()
            .map(|&l| {
                let heads = cfg.layers[l].num_kv_heads.div_ceil(args.tp);
                let hd = cfg.layers[l].head_dim;
                2 * heads * (hd * kv.element_bytes() + kv.scale_bytes(hd))
            })
            .sum();
        per_token_rank += rank_bytes;
        println!(
            "  group {kind:<22} {:>2} KV-owning layers  {:>12}/token  ({} per rank)",
            g.layers.len(),
            human(*bytes as f64),
            human(rank_bytes as f64)
        );
    }
    let shared = cfg
        .layers
        .iter()
        .filter(|l| l.kv != gemma4_model::config::KvSource::Own)
        .count();
    if shared > 0 {
        println!("  {shared} KV-shared layers own no cache");
    }
    let total_token: usize = groups.iter().map(|(_, b)| b).sum();
    println!("  per token, all groups: {}", human(total_token as f64));
    println!(
        "  one sequence of {ctx} tokens: {}",
        human(kv_bytes_for_context(&cfg, ctx, kv) as f64)
    );
    if let Some(r) = resident {
        println!(
            "resident memory of this checkpoint served ({} sequence(s) of {ctx} tokens, quantization {}, KV {kv_shown}):",
            args.max_num_seqs,
            args.quant.name()
        );
        println!("  weights read every step {:>12}", human(r.weights as f64));
        println!("  KV pools                {:>12}", human(r.kv as f64));
        println!("  tokenizer, activations  {:>12}", human(r.runtime as f64));
        if r.media > 0 {
            println!("  vision and audio towers {:>12}", human(r.media as f64));
        }
        if r.adapters > 0 {
            println!("  LoRA adapters           {:>12}", human(r.adapters as f64));
        }
        println!("  predicted peak          {:>12}", human(r.total() as f64));
    }
    if let Some(mem) = &args.mem {
        let budget = parse_size(mem)?;
        let free = budget.saturating_sub(weights_per_rank);
        let scale = total_token as f64 / per_token_rank.max(1) as f64;
        let free_equiv = (free as f64 * scale) as usize;
        println!(
            "memory per device {}: weights {}, left for KV {}",
            human(budget as f64),
            human(weights_per_rank as f64),
            human(free as f64)
        );
        if free == 0 {
            println!("  the weights do not fit: use more ranks (--tp) or a smaller --quant");
            return Ok(ExitCode::FAILURE);
        }
        let fit = tokens_that_fit(&cfg, free_equiv, kv, usize::MAX / 2);
        println!(
            "  one sequence fits up to {} tokens",
            fit.min(cfg.max_position_embeddings)
        );
        let per_seq = kv_bytes_for_context(&cfg, ctx, kv).max(1);
        println!(
            "  sequences of {ctx} tokens at once: {}",
            free_equiv / per_seq
        );
    }
    Ok(ExitCode::SUCCESS)
}
