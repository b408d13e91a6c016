//! The vision and audio towers from a multimodal projector GGUF (`mmproj`,
//! llama.cpp's converter layout): the E-style fixture with both towers
//! (`tests/fixtures/vision/e-audio`) is written as an mmproj file — tensor
//! names, shapes and metadata as the converter writes them, the patch
//! embedding as a channels-first convolution kernel, the audio query scale
//! with its softplus applied, the depthwise kernel as `[C, K]`, scalars as
//! one-element vectors, matrices in f16 — then loaded back, and each image's
//! and the clip's soft tokens held to the reference's.
//!
//! The 12B's fixture (`tests/fixtures/vision/unified`) is written the same
//! way with its encoder-free embedders (`gemma4uv`, `gemma4ua`): the patch
//! projection's columns and the first patch norm reordered channels first,
//! the position table as `[2, T, D]`, `pos_norm` as the third patch norm;
//! that file and the one `tools/make_mmproj_fixture.py` committed
//! (`unified-mmproj.gguf`) are held to its image and audio soft tokens.
//!
//! Both fixtures are also held as llama.cpp's own converter writes them
//! (`convert_hf_to_gguf.py --mmproj`, f16: `tests/fixtures/llamacpp/mmproj`).
//! `GEMMA4_MMPROJ_FILE` (`GEMMA4_UNIFIED_MMPROJ_FILE`) may name another
//! mmproj of the E-style (12B) fixture, to hold to the same goldens.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use gemma4_media::audio::{decode_wav, frames};
use gemma4_media::mel::log_mel;
use gemma4_model::mmproj::mmproj_tensor_name;
use gemma4_model::{read_config, AudioEncoder, AudioFeatures, ImageEncoder};

use common::{encode_image, max_abs_diff, tensor, vision_fixture};

fn vision_dir() -> PathBuf {
    vision_fixture("")
}

/// The fixture's tower tensors (below the multimodal root) as the converter
/// writes them: names, layouts and types.
fn converter_tensors(dir: &Path) -> Vec<(String, QTensor)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, view) in st.tensors() {
        let Some(rel) = name.strip_prefix("model.") else {
            continue;
        };
        if ![
            "vision_tower.",
            "audio_tower.",
            "embed_vision.",
            "embed_audio.",
            "vision_embedder.",
        ]
        .iter()
        .any(|p| rel.starts_with(p))
        {
            continue;
        }
        let g = mmproj_tensor_name(rel).unwrap_or_else(|| panic!("no mmproj name for {rel}"));
        let mut t = Tensor::from_raw_buffer(view.data(), DType::BF16, view.shape(), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("tensor");
        let dims = t.dims().to_vec();
        // p·p pixels of 3 values (channels last) → 3 planes of p·p.
        let channels_first = |t: &Tensor, rows: usize| {
            let pixels = t.elem_count() / rows / 3;
            t.reshape((rows, pixels, 3))
                .and_then(|t| t.transpose(1, 2))
                .and_then(|t| t.contiguous())
                .and_then(|t| t.reshape(dims.as_slice()))
                .expect("channels first")
        };
        if rel == "vision_tower.patch_embedder.input_proj.weight" {
            // [D, p·p·3] (pixels, channels last) → [D, 3, p, p].
            let p = ((dims[1] / 3) as f64).sqrt() as usize;
            t = channels_first(&t, dims[0])
                .reshape((dims[0], 3, p, p))
                .expect("kernel");
        } else if rel == "vision_embedder.patch_dense.weight" {
            // The columns reordered as ggml's im2col lays out a patch.
            t = channels_first(&t, dims[0]);
        } else if rel.starts_with("vision_embedder.patch_ln1.") {
            t = channels_first(&t, 1);
        } else if rel == "vision_embedder.pos_embedding" {
            // [T, 2, D] → [2, T, D]: the x table, then the y table.
            t = t
                .transpose(0, 1)
                .and_then(|t| t.contiguous())
                .expect("tables");
        } else if rel.ends_with("self_attn.per_dim_scale") {
            t = (t.exp().expect("exp") + 1.0)
                .and_then(|t| t.log())
                .expect("softplus");
        } else if rel.ends_with("depthwise_conv1d.weight") {
            t = t.reshape((dims[0], dims[2])).expect("reshape");
        } else if dims.is_empty() {
            t = t.reshape(1).expect("reshape");
        }
        // Matrices in f16, as a `--outtype f16` conversion; everything the
        // converter keeps in f32 (vectors, norms, tables, kernels) in f32.
        let keep_f32 = !(t.dims().len() == 2 || g == "v.patch_embd.weight")
            || !g.ends_with(".weight")
            || g.contains("norm")
            || g.starts_with("a.conv1d")
            || g.contains("conv_dw")
            || g == "a.input_projection.weight";
        let dtype = if keep_f32 {
            GgmlDType::F32
        } else {
            GgmlDType::F16
        };
        tensors.push((g, QTensor::quantize(&t, dtype).expect("qtensor")));
    }
    tensors
}

/// Writes an mmproj file of these tensors and metadata under the temporary
/// directory.
fn write_gguf(tag: &str, meta: &[(&str, Value)], tensors: &[(String, QTensor)]) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("gemma4-mmproj-{tag}-{}.gguf", std::process::id()));
    let mut file = std::fs::File::create(&path).expect("create");
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs).expect("write gguf");
    path
}

fn text(s: &str) -> Value {
    Value::String(s.into())
}

fn u(x: &serde_json::Value) -> Value {
    Value::U32(x.as_u64().expect("number") as u32)
}

/// The fixture's towers as an mmproj file in the converter's layout.
fn write_mmproj(dir: &Path) -> PathBuf {
    let json = read_config(dir).expect("config");
    let tensors = converter_tensors(dir);
    let v = &json["vision_config"];
    let a = &json["audio_config"];
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", text("clip")),
        ("general.type", text("mmproj")),
        ("clip.has_vision_encoder", Value::Bool(true)),
        ("clip.has_audio_encoder", Value::Bool(true)),
        ("clip.vision.projector_type", text("gemma4v")),
        ("clip.audio.projector_type", text("gemma4a")),
        ("clip.vision.image_size", Value::U32(224)),
        ("clip.vision.patch_size", u(&v["patch_size"])),
        ("clip.vision.embedding_length", u(&v["hidden_size"])),
        (
            "clip.vision.feed_forward_length",
            u(&v["intermediate_size"]),
        ),
        ("clip.vision.block_count", u(&v["num_hidden_layers"])),
        (
            "clip.vision.attention.head_count",
            u(&v["num_attention_heads"]),
        ),
        ("clip.vision.attention.layer_norm_epsilon", Value::F32(1e-6)),
        ("clip.audio.embedding_length", u(&a["hidden_size"])),
        ("clip.audio.block_count", u(&a["num_hidden_layers"])),
        (
            "clip.audio.attention.head_count",
            u(&a["num_attention_heads"]),
        ),
        ("clip.audio.num_mel_bins", Value::U32(128)),
    ];
    write_gguf("e", &meta, &tensors)
}

/// The 12B fixture's encoder-free embedders as an mmproj file in the
/// converter's layout (`Gemma4UnifiedVisionAudioModel`): the towers'
/// settings written as zeros, the vision width as `mm_embed_dim`, the
/// audio width as the frame width, 128 "mel bins" (llama.cpp reads 640).
fn write_unified_mmproj(dir: &Path) -> PathBuf {
    let json = read_config(dir).expect("config");
    let tensors = converter_tensors(dir);
    let v = &json["vision_config"];
    let a = &json["audio_config"];
    let hidden = u(&json["text_config"]["hidden_size"]);
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", text("clip")),
        ("general.type", text("mmproj")),
        ("general.file_type", Value::U32(1)),
        ("clip.has_vision_encoder", Value::Bool(true)),
        ("clip.vision.projection_dim", hidden.clone()),
        ("clip.vision.image_size", Value::U32(224)),
        ("clip.vision.patch_size", u(&v["patch_size"])),
        ("clip.vision.embedding_length", u(&v["mm_embed_dim"])),
        ("clip.vision.feed_forward_length", Value::U32(0)),
        ("clip.vision.block_count", Value::U32(0)),
        ("clip.vision.attention.head_count", Value::U32(0)),
        ("clip.has_audio_encoder", Value::Bool(true)),
        ("clip.audio.projection_dim", hidden),
        ("clip.audio.embedding_length", u(&a["audio_embed_dim"])),
        ("clip.audio.feed_forward_length", Value::U32(0)),
        ("clip.audio.block_count", Value::U32(0)),
        ("clip.audio.attention.head_count", Value::U32(0)),
        ("clip.vision.projector_type", text("gemma4uv")),
        ("clip.vision.attention.layer_norm_epsilon", Value::F32(1e-6)),
        ("clip.audio.projector_type", text("gemma4ua")),
        ("clip.audio.num_mel_bins", Value::U32(128)),
        ("clip.audio.attention.layer_norm_epsilon", Value::F32(1e-6)),
    ];
    write_gguf("unified", &meta, &tensors)
}

/// The fixture's mmproj as llama.cpp's converter wrote it.
fn llama_cpp_mmproj(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llamacpp/mmproj")
        .join(format!("{variant}-f16.gguf"))
}

fn golden(dir: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir.join("golden_tensors.safetensors")).expect("goldens");
    tensor(&bytes, name).1
}

/// The largest magnitude of a golden, at least 1.
fn scale(x: &[f32]) -> f32 {
    x.iter().fold(1.0f32, |m, v| m.max(v.abs()))
}

/// Every image's and the clip's soft tokens through the mmproj's towers.
fn check(mmproj: &Path) {
    let dir = vision_dir().join("e-audio");
    let json = read_config(&dir).expect("config");
    let hidden = json["text_config"]["hidden_size"].as_u64().unwrap() as usize;
    let (images, _) = ImageEncoder::load_mmproj(mmproj, hidden, &json)
        .expect("load vision")
        .expect("a vision tower");
    // The token ids come from the text checkpoint's config.
    assert_eq!(images.tokens().soft, 500);
    for i in 0..4 {
        let ours = encode_image(&images, i);
        // As from the safetensors checkpoint: the fixture's bf16 weights are
        // exact in f16 too.
        assert_close(
            &format!("{}: image {i}", mmproj.display()),
            &ours,
            &golden(&dir, &format!("features.{i}")),
        );
    }
    let (audio, _) = AudioEncoder::load_mmproj(mmproj, hidden, &json)
        .expect("load audio")
        .expect("an audio tower");
    let wav = std::fs::read(vision_dir().join("audio/0.wav")).expect("wav");
    let clip = decode_wav(&wav, 30.0).expect("decode");
    let ours: Vec<f32> = audio
        .encode(&log_mel(&clip).expect("mel").values)
        .expect("encode")
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_close(
        &format!("{}: audio 0", mmproj.display()),
        &ours,
        &golden(&dir, "audio_features.0"),
    );
}

/// Soft tokens against the reference's: f32 against f32, within 1e-4 of
/// the largest value.
fn assert_close(label: &str, ours: &[f32], want: &[f32]) {
    let diff = max_abs_diff(ours, want);
    eprintln!(
        "{label}: max |Δ| {diff:.2e} (largest value {:.2})",
        scale(want)
    );
    assert!(diff <= 1e-4 * scale(want), "{label}: {diff}");
}

#[test]
fn towers_from_an_mmproj_file_match_the_reference() {
    let path = write_mmproj(&vision_dir().join("e-audio"));
    check(&path);
    let _ = std::fs::remove_file(path);
    check(&llama_cpp_mmproj("e-audio"));
    if let Some(other) = std::env::var_os("GEMMA4_MMPROJ_FILE") {
        check(Path::new(&other));
    }
}

/// Every image's and the clip's soft tokens through the 12B fixture's
/// encoder-free embedders from an mmproj file.
fn check_unified(mmproj: &Path) {
    let dir = vision_dir().join("unified");
    let json = read_config(&dir).expect("config");
    let hidden = json["text_config"]["hidden_size"].as_u64().unwrap() as usize;
    let (images, _) = ImageEncoder::load_mmproj(mmproj, hidden, &json)
        .expect("load vision")
        .expect("an image embedder");
    assert!(
        images.takes_merged_patches(),
        "not the encoder-free embedder"
    );
    assert_eq!(images.tokens().soft, 500);
    assert_eq!(images.video_tokens().soft, 506);
    for i in 0..4 {
        let ours = encode_image(&images, i);
        assert_close(
            &format!("{}: unified image {i}", mmproj.display()),
            &ours,
            &golden(&dir, &format!("features.{i}")),
        );
    }
    let (audio, _) = AudioEncoder::load_mmproj(mmproj, hidden, &json)
        .expect("load audio")
        .expect("an audio embedder");
    assert_eq!(audio.features(), AudioFeatures::Frames(640));
    assert_eq!(audio.tokens().soft, 503);
    let wav = std::fs::read(vision_dir().join("audio/0.wav")).expect("wav");
    let clip = decode_wav(&wav, 30.0).expect("decode");
    let ours: Vec<f32> = audio
        .encode(&frames(&clip, 640))
        .expect("encode")
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_close(
        &format!("{}: unified audio 0", mmproj.display()),
        &ours,
        &golden(&dir, "audio_features.0"),
    );
}

#[test]
fn the_12b_embedders_from_an_mmproj_file_match_the_reference() {
    let path = write_unified_mmproj(&vision_dir().join("unified"));
    check_unified(&path);
    let _ = std::fs::remove_file(path);
    // The same layout written by `tools/make_mmproj_fixture.py`.
    check_unified(&vision_dir().join("unified-mmproj.gguf"));
    check_unified(&llama_cpp_mmproj("unified"));
    if let Some(other) = std::env::var_os("GEMMA4_UNIFIED_MMPROJ_FILE") {
        check_unified(Path::new(&other));
    }
}

#[test]
fn a_text_gguf_is_not_a_projector() {
    let vocab = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/text/ggml-vocab-gemma-4.gguf");
    let Err(e) = ImageEncoder::load_mmproj(&vocab, 64, &serde_json::json!({})) else {
        panic!("a text GGUF loaded as a projector");
    };
    assert!(e.to_string().contains("expected `clip`"), "{e}");
}
