//! The real-vocabulary checkpoint: Gemma 4's real tokenizer and chat
//! template with tiny random weights. The repository keeps its description
//! (`tests/fixtures/oracle/real-vocab`: the compressed tokenizer, the config
//! and each tensor's shape and spread); this writes a loadable checkpoint
//! from it once per test run. `GEMMA4_REAL_VOCAB` names an existing one instead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::harness::{fixture, python};

/// The checkpoint's directory, built on first use.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| match std::env::var_os("GEMMA4_REAL_VOCAB") {
        Some(dir) => PathBuf::from(dir),
        None => build(
            &fixture("real-vocab"),
            Path::new(env!("CARGO_TARGET_TMPDIR")),
        ),
    })
}

const COPIED: [&str; 4] = [
    "config.json",
    "chat_template.jinja",
    "tokenizer_config.json",
    "generation_config.json",
];

fn build(spec: &Path, tmp: &Path) -> PathBuf {
    let out = tmp.join("real-vocab");
    // Built beside the final place and renamed, so a half-written folder is never used.
    let work = tmp.join(format!("real-vocab.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("create the checkpoint folder");
    for name in COPIED {
        std::fs::copy(spec.join(name), work.join(name)).expect(name);
    }
    // Python's lzma module is the decompressor at hand wherever the client tests run.
    let status = Command::new(python())
        .args([
            "-c",
            "import lzma, shutil, sys\n\
             with lzma.open(sys.argv[1]) as src, open(sys.argv[2], 'wb') as dst:\n    \
             shutil.copyfileobj(src, dst)",
        ])
        .arg(spec.join("tokenizer.json.xz"))
        .arg(work.join("tokenizer.json"))
        .status()
        .expect("run python to decompress tokenizer.json.xz");
    assert!(status.success(), "decompressing tokenizer.json.xz failed");
    write_weights(&spec.join("weights.json"), &work.join("model.safetensors"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::rename(&work, &out).expect("move the checkpoint into place");
    out
}

/// Each tensor drawn from a normal distribution with the mean and spread of
/// the original's, from a fixed seed, stored as bf16.
fn write_weights(spec: &Path, dst: &Path) {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(spec).expect("weights.json")).expect("json");
    let tensors = spec["tensors"].as_array().expect("tensors");
    let mut rng = Normal::new(606);
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in tensors {
        let name = t["name"].as_str().expect("name").to_string();
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let (mean, std) = (
            t["mean"].as_f64().expect("mean"),
            t["std"].as_f64().expect("std"),
        );
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| half::bf16::from_f64(mean + std * rng.sample()).to_le_bytes())
            .collect();
        data.push((name, shape, bytes));
    }
    let views = data.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes)
                .expect("view");
        (name.as_str(), view)
    });
    safetensors::serialize_to_file(views, None, dst).expect("write model.safetensors");
}

/// A seeded standard normal generator (xorshift64* and Box-Muller).
struct Normal(u64);

impl Normal {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn sample(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}
