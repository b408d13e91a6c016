//! Gemma 4 in llama.cpp's GGUF layout: each oracle fixture is written as a
//! `gemma4` GGUF (f32 tensors under llama.cpp's names and metadata keys,
//! k/v projections of KV-shared layers dropped as llama.cpp does), loaded
//! back through the GGUF path, and held to the same reference outputs.

use std::path::PathBuf;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use gemma4_model::config::{AttentionKind, KvSource, TextConfig};
use gemma4_model::gguf_source::gguf_name;
use gemma4_model::golden::{verify_prompt, Golden, DEFAULT_TOLERANCE};
use gemma4_model::{load, LoadPolicy};

fn fixture(v: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(v)
}

fn write_gguf(variant: &str) -> PathBuf {
    let dir = fixture(variant);
    let cfg = TextConfig::from_dir(&dir).expect("config");
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, view) in st.tensors() {
        let rel = name.strip_prefix("model.language_model.").expect("prefix");
        let shared_kv = cfg.layers.iter().enumerate().any(|(i, l)| {
            let attn = format!("layers.{i}.self_attn.");
            l.kv != KvSource::Own
                && (rel.starts_with(&format!("{attn}k")) || rel.starts_with(&format!("{attn}v")))
        });
        if shared_kv {
            continue;
        }
        let g = gguf_name(rel).unwrap_or_else(|| panic!("no GGUF name for {rel}"));
        let t = Tensor::from_raw_buffer(view.data(), DType::BF16, view.shape(), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("tensor");
        tensors.push((g, QTensor::quantize(&t, GgmlDType::F32).expect("qtensor")));
    }
    let full = cfg
        .layers
        .iter()
        .find(|l| l.kind == AttentionKind::Full)
        .expect("full layer");
    let sliding = cfg
        .layers
        .iter()
        .find(|l| l.kind == AttentionKind::Sliding)
        .expect("sliding layer");
    let half = full.head_dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| {
            if i < full.rope.rotated_pairs {
                1.0
            } else {
                1e30
            }
        })
        .collect();
    let freqs = Tensor::from_vec(freqs, half, &Device::Cpu).expect("freqs");
    tensors.push((
        "rope_freqs.weight".into(),
        QTensor::quantize(&freqs, GgmlDType::F32).expect("q"),
    ));
    let n = cfg.num_layers();
    let u = |x: usize| Value::U32(x as u32);
    let per_layer = |f: &dyn Fn(usize) -> usize| Value::Array((0..n).map(|i| u(f(i))).collect());
    let mut meta: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("gemma4".into()),
        ),
        ("gemma4.block_count".into(), u(n)),
        (
            "gemma4.context_length".into(),
            u(cfg.max_position_embeddings),
        ),
        ("gemma4.embedding_length".into(), u(cfg.hidden_size)),
        (
            "gemma4.feed_forward_length".into(),
            per_layer(&|i| cfg.layers[i].intermediate_size),
        ),
        (
            "gemma4.attention.head_count".into(),
            u(cfg.num_attention_heads),
        ),
        (
            "gemma4.attention.head_count_kv".into(),
            per_layer(&|i| cfg.layers[i].num_kv_heads),
        ),
        ("gemma4.attention.key_length".into(), u(full.head_dim)),
        (
            "gemma4.attention.key_length_swa".into(),
            u(sliding.head_dim),
        ),
        (
            "gemma4.attention.sliding_window".into(),
            u(cfg.sliding_window),
        ),
        (
            "gemma4.attention.sliding_window_pattern".into(),
            Value::Array(
                cfg.layers
                    .iter()
                    .map(|l| Value::Bool(l.kind == AttentionKind::Sliding))
                    .collect(),
            ),
        ),
        (
            "gemma4.attention.shared_kv_layers".into(),
            u(cfg.layers.iter().filter(|l| l.kv != KvSource::Own).count()),
        ),
        (
            "gemma4.embedding_length_per_layer_input".into(),
            u(cfg.ple_dim),
        ),
        (
            "gemma4.rope.freq_base".into(),
            Value::F32(full.rope.theta as f32),
        ),
        (
            "gemma4.rope.freq_base_swa".into(),
            Value::F32(sliding.rope.theta as f32),
        ),
        (
            "gemma4.attention.layer_norm_rms_epsilon".into(),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        ("gemma4.final_logit_softcapping".into(), Value::F32(30.0)),
    ];
    if let Some(m) = cfg.moe {
        meta.push(("gemma4.expert_count".into(), u(m.num_experts)));
        meta.push(("gemma4.expert_used_count".into(), u(m.top_k)));
        meta.push((
            "gemma4.expert_feed_forward_length".into(),
            u(m.intermediate_size),
        ));
    }
    let path = std::env::temp_dir().join(format!("gemma4-{variant}-{}.gguf", std::process::id()));
    let mut file = std::fs::File::create(&path).expect("create");
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs).expect("write gguf");
    path
}

#[test]
fn gemma4_gguf_matches_the_reference() {
    for v in ["e-style", "dense-k-eq-v", "moe"] {
        let path = write_gguf(v);
        let model = load(&path, LoadPolicy::default()).unwrap_or_else(|e| panic!("{v}: {e}"));
        let hf = TextConfig::from_dir(&fixture(v)).expect("config");
        assert_eq!(model.config().layers, hf.layers, "{v}");
        let golden = Golden::read(&fixture(v).join("golden.json")).expect("golden");
        for p in &golden.prompts {
            let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
            assert!(r.seq_match, "{v}/{}: {r:?}", p.name);
        }
        let _ = std::fs::remove_file(path);
    }
}
