//! Damaged or trimmed checkpoints: what must load, and the errors that name
//! the problem when it cannot.

use std::path::{Path, PathBuf};

use gemma4_model::golden::{verify_prompt, Golden, DEFAULT_TOLERANCE};
use gemma4_model::load_hf_dir;
use safetensors::tensor::TensorView;

fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(variant)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gemma4-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Copies a fixture, keeping only the tensors `keep` accepts.
fn copy_without(variant: &str, name: &str, keep: impl Fn(&str) -> bool) -> PathBuf {
    let src = fixture(variant);
    let dst = scratch(name);
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "golden.json",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy");
    }
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let kept: Vec<(String, TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    safetensors::serialize_to_file(kept, None, &dst.join("model.safetensors")).expect("write");
    dst
}

fn is_shared_kv_tensor(name: &str) -> bool {
    ["5", "6", "7"].iter().any(|l| {
        [
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.k_norm.weight",
        ]
        .iter()
        .any(|t| name == format!("model.language_model.layers.{l}.{t}"))
    })
}

#[test]
fn kv_shared_layers_need_no_k_v_projections() {
    let dir = copy_without("e-style", "qat-like", |n| !is_shared_kv_tensor(n));
    let model = load_hf_dir(&dir).expect("loads without the shared layers' k/v tensors");
    let golden = Golden::read(&dir.join("golden.json")).expect("golden");
    for p in &golden.prompts {
        let r = verify_prompt(&model, p, DEFAULT_TOLERANCE).expect("verify");
        assert!(r.seq_match, "{}: {r:?}", p.name);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_tensor_is_named() {
    let missing = "model.language_model.layers.2.mlp.up_proj.weight";
    let dir = copy_without("e-style", "missing", |n| n != missing);
    let err = load_hf_dir(&dir).expect_err("must fail").to_string();
    assert!(err.contains(missing), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_layer_scalar_is_named() {
    let missing = "model.language_model.layers.0.layer_scalar";
    let dir = copy_without("dense-k-eq-v", "no-scalar", |n| n != missing);
    let err = load_hf_dir(&dir).expect_err("must fail").to_string();
    assert!(err.contains(missing), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_wrong_shape_names_tensor_and_shapes() {
    let src = fixture("e-style");
    let dir = scratch("shape");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy");
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("read"))
            .expect("json");
    cfg["text_config"]["intermediate_size"] = serde_json::Value::from(100);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write");
    let err = load_hf_dir(&dir).expect_err("must fail").to_string();
    assert!(
        err.contains("model.language_model.layers.0.mlp.gate_proj.weight"),
        "{err}"
    );
    assert!(
        err.contains("[100, 64]") && err.contains("[128, 64]"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_truncated_file_is_an_error_not_a_panic() {
    let src = fixture("moe");
    let dir = scratch("truncated");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).expect("copy");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    for keep in [bytes.len() / 2, 100, 7] {
        std::fs::write(dir.join("model.safetensors"), &bytes[..keep]).expect("write");
        let err = load_hf_dir(&dir).expect_err("must fail").to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn malformed_config_and_missing_dir() {
    let dir = scratch("badconfig");
    std::fs::write(
        dir.join("config.json"),
        "{\"model_type\": \"gemma4\", \"text_config\": ",
    )
    .expect("write");
    let err = load_hf_dir(&dir).expect_err("must fail").to_string();
    assert!(
        err.contains("config.json") && err.contains("not valid JSON"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let err = load_hf_dir(Path::new("/nonexistent/gemma"))
        .expect_err("must fail")
        .to_string();
    assert!(
        err.contains("/nonexistent/gemma") && err.contains("does not exist"),
        "{err}"
    );
}

/// A checkpoint split into shards with `model.safetensors.index.json` loads
/// and gives the reference outputs.
#[test]
fn sharded_checkpoints_load() {
    let src = fixture("moe");
    let dst = scratch("sharded");
    for f in ["config.json", "golden.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy");
    }
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", i + 1);
        let views: Vec<(String, TensorView)> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).expect("tensor")))
            .collect();
        safetensors::serialize_to_file(views, None, &dst.join(&file)).expect("write shard");
        for n in part {
            weight_map.insert(n.clone(), serde_json::Value::from(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).expect("index");
    let model = load_hf_dir(&dst).expect("sharded checkpoint loads");
    let golden = Golden::read(&dst.join("golden.json")).expect("golden");
    for p in &golden.prompts {
        assert!(
            verify_prompt(&model, p, DEFAULT_TOLERANCE)
                .expect("verify")
                .seq_match,
            "{}",
            p.name
        );
    }
    let _ = std::fs::remove_dir_all(dst);
}

/// Copies the compressed-tensors fixture with `extra` tensors added, or
/// replacing those of the same name.
fn compressed_copy_with(name: &str, extra: Vec<(String, TensorView)>) -> PathBuf {
    let src = fixture("e-style-int4-ct");
    let dst = scratch(name);
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy");
    }
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !extra.iter().any(|(e, _)| e == n))
        .collect();
    tensors.extend(extra);
    safetensors::serialize_to_file(tensors, None, &dst.join("model.safetensors")).expect("write");
    dst
}

/// Packed int4 variants that cannot load as stored are errors that name the
/// tensor and what it uses: a zero point (asymmetric), groups narrower
/// than 32 columns, and a packing of another width.
#[test]
fn unsupported_compressed_tensors_layouts_are_named() {
    use safetensors::Dtype;
    let base = "model.language_model.layers.1.mlp.down_proj";
    let zeros = vec![0u8; 8 * 4 * 4];
    let zero_point = TensorView::new(Dtype::I32, vec![8, 4], &zeros).expect("zero point");
    let scales = vec![0u8; 64 * 8 * 2];
    let narrow = TensorView::new(Dtype::BF16, vec![64, 8], &scales).expect("scales");
    let packed = vec![0u8; 64 * 32 * 4];
    let eight_bit = TensorView::new(Dtype::I32, vec![64, 32], &packed).expect("packed");
    for (case, tensor, want) in [
        (
            "zero-point",
            (format!("{base}.weight_zero_point"), zero_point),
            "asymmetric",
        ),
        (
            "narrow-groups",
            (format!("{base}.weight_scale"), narrow),
            "groups of 16 columns",
        ),
        (
            "eight-bit",
            (format!("{base}.weight_packed"), eight_bit),
            "weights of 8 bits",
        ),
    ] {
        let dir = compressed_copy_with(case, vec![tensor]);
        let err = load_hf_dir(&dir).expect_err(case).to_string();
        assert!(err.contains(base) && err.contains(want), "{case}: {err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
