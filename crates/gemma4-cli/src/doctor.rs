//! `gemma4 doctor`: the checks that catch what silently breaks a port,
//! each printed as one PASS / WARN / FAIL line with the fix.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use gemma4_model::config::TextConfig;
use gemma4_text::{ChatTemplate, Tokenizer};
use serde_json::json;

use crate::model_io::{load_tokenizer, ModelArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Default)]
struct Report {
    failures: usize,
}

impl Report {
    fn pass(&mut self, check: &str, detail: impl AsRef<str>) {
        println!("PASS {check}: {}", detail.as_ref());
    }
    fn warn(&mut self, check: &str, detail: impl AsRef<str>) {
        println!("WARN {check}: {}", detail.as_ref());
    }
    fn fail(&mut self, check: &str, detail: impl AsRef<str>, fix: impl AsRef<str>) {
        self.failures += 1;
        println!("FAIL {check}: {} (fix: {})", detail.as_ref(), fix.as_ref());
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = args.model.path()?;
    let mut r = Report::default();
    println!("checking {}", path.display());
    if !path.exists() {
        r.fail(
            "model",
            format!("{} does not exist", path.display()),
            "pass --model DIR_OR_GGUF",
        );
        return Ok(ExitCode::FAILURE);
    }
    let why = match std::env::var("GEMMA4_KERNEL_LEVEL") {
        Ok(cap) => format!("at most {cap:?}, as GEMMA4_KERNEL_LEVEL says"),
        Err(_) => "the widest this CPU has".to_string(),
    };
    r.pass("kernels", format!("{} ({why})", gemma4_kernels::describe()));
    let gguf = gemma4_model::gguf_file(&path)?.is_some();
    let config = check_config(&mut r, &path);
    let tokenizer = check_tokenizer(&mut r, &path, config.as_ref());
    if let Some(tok) = &tokenizer {
        check_template(&mut r, &args.model, tok, gguf);
    }
    if let Some(cfg) = &config {
        check_weights(&mut r, &path, cfg, args.model.policy());
    }
    if r.failures == 0 {
        println!("doctor: all checks passed");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("doctor: {} check(s) failed", r.failures);
        Ok(ExitCode::FAILURE)
    }
}

fn check_config(r: &mut Report, path: &Path) -> Option<TextConfig> {
    let cfg = match gemma4_model::gguf_file(path) {
        Ok(Some(file)) => gemma4_model::GgufSource::open(&file).and_then(|s| s.config()),
        Ok(None) => TextConfig::from_dir(path).map_err(Into::into),
        Err(e) => Err(e),
    };
    match cfg {
        Ok(c) => {
            let shared = c
                .layers
                .iter()
                .filter(|l| l.kv != gemma4_model::config::KvSource::Own)
                .count();
            r.pass(
                "config",
                format!(
                    "{}: {} layers, hidden {}, vocab {}, {shared} KV-shared layers",
                    c.model_type,
                    c.num_layers(),
                    c.hidden_size,
                    c.vocab_size
                ),
            );
            if !c.unknown_keys.is_empty() {
                r.warn(
                    "config",
                    format!(
                        "ignored keys this version does not know: {}",
                        c.unknown_keys.join(", ")
                    ),
                );
            }
            Some(c)
        }
        Err(e) => {
            r.fail(
                "config",
                e.to_string(),
                "correct the named field of config.json (or use the checkpoint's original file)",
            );
            None
        }
    }
}

fn check_tokenizer(r: &mut Report, path: &Path, cfg: Option<&TextConfig>) -> Option<Tokenizer> {
    let tok = match load_tokenizer(path) {
        Ok(t) => t,
        Err(e) => {
            r.fail(
                "tokenizer",
                format!("{e:#}"),
                "copy the checkpoint's tokenizer.json next to config.json",
            );
            return None;
        }
    };
    let text = "hello world";
    match tok
        .encode(text, false)
        .and_then(|ids| tok.decode(&ids, false).map(|d| (ids, d)))
    {
        Ok((ids, back)) if back == text && !ids.is_empty() => {
            r.pass("tokenizer", format!("{text:?} → {ids:?} → {back:?}"))
        }
        Ok((ids, back)) => r.fail(
            "tokenizer",
            format!("{text:?} → {ids:?} decodes to {back:?}"),
            "use the checkpoint's own tokenizer.json",
        ),
        Err(e) => r.fail(
            "tokenizer",
            e.to_string(),
            "use the checkpoint's own tokenizer.json",
        ),
    }
    if let Some(c) = cfg {
        if tok.vocab_size() > c.vocab_size {
            r.fail(
                "tokenizer",
                format!(
                    "{} tokens but the model has {} embedding rows",
                    tok.vocab_size(),
                    c.vocab_size
                ),
                "pair the tokenizer with its own model",
            );
        }
    }
    // Chat markers must be single tokens, or prompts silently turn into characters.
    let markers: &[&str] = if tok.token_to_id("<|turn>").is_some() {
        &[
            "<|turn>",
            "<turn|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|channel>",
            "<channel|>",
            "<|\"|>",
        ]
    } else {
        &["<start_of_turn>", "<end_of_turn>"]
    };
    let mut bad = Vec::new();
    for m in markers {
        match tok.encode(m, false) {
            Ok(ids) if ids.len() == 1 && tok.token_to_id(m) == Some(ids[0]) => {}
            _ => bad.push(*m),
        }
    }
    if bad.is_empty() {
        r.pass(
            "turn tokens",
            format!("{} are single ids", markers.join(" ")),
        );
    } else {
        r.fail(
            "turn tokens",
            format!("{} do not encode as single ids", bad.join(" ")),
            "the tokenizer must declare them as added/special tokens",
        );
    }
    let stops = tok.stop_token_ids();
    if stops.is_empty() {
        r.fail(
            "stop tokens",
            "none of <eos>, <turn|>, <|tool_response>, <end_of_turn> is in the vocabulary",
            "use the checkpoint's own tokenizer",
        );
    } else {
        r.pass("stop tokens", format!("{stops:?}"));
    }
    Some(tok)
}

fn check_template(r: &mut Report, model: &ModelArgs, tok: &Tokenizer, gguf: bool) {
    let template = match model.template(tok) {
        Ok(t) => t,
        Err(_) if gguf && model.chat_template.is_none() => {
            r.warn("chat template", "the GGUF has no tokenizer.chat_template (a base model): it serves completions; chat needs --chat-template FILE");
            return;
        }
        Err(e) => {
            r.fail(
                "chat template",
                format!("{e:#}"),
                "add the checkpoint's chat_template.jinja, or pass --chat-template FILE",
            );
            return;
        }
    };
    render_check(r, &template, tok);
}

fn render_check(r: &mut Report, template: &ChatTemplate, tok: &Tokenizer) {
    let messages = json!([{"role": "user", "content": "Hello"}]);
    let text = match template.render(&messages, None, true, &serde_json::Map::new()) {
        Ok(t) => t,
        Err(e) => {
            r.fail(
                "chat template",
                e.to_string(),
                "fix the template or pass a working one with --chat-template FILE",
            );
            return;
        }
    };
    let markers = ["<|turn>", "<turn|>", "<start_of_turn>", "<end_of_turn>"];
    let ids = match tok.encode(&text, false) {
        Ok(ids) => ids,
        Err(e) => {
            r.fail(
                "chat template",
                e.to_string(),
                "use the checkpoint's own tokenizer",
            );
            return;
        }
    };
    let mut found = 0;
    for m in markers {
        let in_text = text.matches(m).count();
        if in_text == 0 {
            continue;
        }
        found += in_text;
        let id = tok.token_to_id(m);
        let in_ids = ids.iter().filter(|&&i| Some(i) == id).count();
        if in_ids != in_text {
            r.fail(
                "chat template",
                format!("{m} appears {in_text}× in the rendered text but {in_ids}× as a token"),
                "the template must use the tokenizer's own turn tokens",
            );
            return;
        }
    }
    if found == 0 {
        r.fail(
            "chat template",
            format!("the rendered prompt {text:?} has no turn markers"),
            "use the checkpoint's own chat template",
        );
    } else {
        r.pass(
            "chat template",
            format!("renders {text:?} with turn markers as single ids"),
        );
    }
}

fn check_weights(r: &mut Report, path: &Path, cfg: &TextConfig, policy: gemma4_model::LoadPolicy) {
    match gemma4_model::load_with(path, policy, None) {
        Ok(loaded) => {
            let unused = loaded.unused;
            let rep = &loaded.report;
            let mut storage = format!(
                "weights load as {}; quantization: {}; resident ≈ {:.0} MiB, tables read by row {:.0} MiB",
                rep.storage_summary(),
                policy.quant.name(),
                rep.resident_bytes as f64 / (1 << 20) as f64,
                rep.table_bytes as f64 / (1 << 20) as f64,
            );
            if policy.quant == gemma4_model::Quant::Q4 && rep.q4_grid_detected() {
                storage
                    .push_str("; on a Q4_0 grid already (quantization-aware training): lossless");
            }
            r.pass("storage", storage);
            r.pass(
                "weights",
                format!(
                    "every tensor the config implies is present with the right shape ({} layers)",
                    cfg.num_layers()
                ),
            );
            if cfg.conventions.layer_scalar {
                r.pass(
                    "layer_scalar",
                    format!("loaded for all {} layers", cfg.num_layers()),
                );
            }
            let shared_kv: Vec<&String> = unused
                .iter()
                .filter(|n| is_shared_kv_tensor(n, cfg))
                .collect();
            let other: Vec<&String> = unused
                .iter()
                .filter(|n| !is_shared_kv_tensor(n, cfg))
                .collect();
            if !shared_kv.is_empty() {
                r.pass(
                    "unused tensors",
                    format!(
                        "{} k/v tensors of KV-shared layers are stored but unused, as expected",
                        shared_kv.len()
                    ),
                );
            }
            if other.is_empty() {
                r.pass(
                    "unused tensors",
                    if shared_kv.is_empty() {
                        "none"
                    } else {
                        "none besides those"
                    },
                );
            } else {
                let shown: Vec<&str> = other.iter().take(8).map(|s| s.as_str()).collect();
                r.warn(
                    "unused tensors",
                    format!(
                        "{} stored tensors are not used by the text model: {}{}",
                        other.len(),
                        shown.join(", "),
                        if other.len() > 8 { ", …" } else { "" }
                    ),
                );
            }
        }
        Err(e) => {
            let msg = e.to_string();
            let check = if msg.contains("layer_scalar") {
                "layer_scalar"
            } else {
                "weights"
            };
            r.fail(
                check,
                msg,
                "the config and the weights must come from the same checkpoint",
            );
        }
    }
}

fn is_shared_kv_tensor(name: &str, cfg: &TextConfig) -> bool {
    cfg.layers.iter().enumerate().any(|(i, l)| {
        l.kv != gemma4_model::config::KvSource::Own
            && [
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.k_norm.weight",
            ]
            .iter()
            .any(|t| name.ends_with(&format!("layers.{i}.{t}")))
    })
}
