//! The executor seam holds: the engine's scheduler, KV manager, loop and
//! request API, and the whole server crate, name no tensor library, tensor
//! or model type, and the server does not depend on the model crate at all
//! (its media go to the executor's encoders as pixels and samples). Only
//! the executors behind the seam reach the model.

use std::path::{Path, PathBuf};

/// Identifiers that belong behind the seam.
const BEHIND_THE_SEAM: &[&str] = &["candle_core", "candle", "Tensor", "Gemma4"];

/// Engine files in front of the seam.
const ENGINE_FRONT: &[&str] = &[
    "adapters.rs",
    "api.rs",
    "block_hash.rs",
    "engine.rs",
    "executor.rs",
    "kv_manager.rs",
    "lib.rs",
    "limits.rs",
    "media.rs",
    "output_processor.rs",
    "sampler.rs",
    "scheduler.rs",
    "speculative.rs",
    "threaded_executor.rs",
];

fn crate_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name)
}

/// `file:line: identifier` for each identifier of `BEHIND_THE_SEAM` in the
/// file's code (comments included: a doc link names a type too).
fn offences(path: &Path) -> Vec<String> {
    offences_of(path, BEHIND_THE_SEAM)
}

fn offences_of(path: &Path, words: &[&str]) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("source file");
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for word in line.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if words.contains(&word) {
                found.push(format!("{}:{}: {word}", path.display(), n + 1));
            }
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_engine_front_and_the_server_name_nothing_behind_the_seam() {
    let engine = crate_dir("gemma4-engine").join("src");
    let files: Vec<PathBuf> = ENGINE_FRONT.iter().map(|f| engine.join(f)).collect();
    let mut server = Vec::new();
    rust_files(&crate_dir("gemma4-server").join("src"), &mut server);
    let model_crate = [BEHIND_THE_SEAM, &["gemma4_model"]].concat();
    let found: Vec<String> = files
        .iter()
        .flat_map(|f| offences(f))
        .chain(server.iter().flat_map(|f| offences_of(f, &model_crate)))
        .collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
    // The server builds without the model crate or a tensor library.
    let manifest = std::fs::read_to_string(crate_dir("gemma4-server").join("Cargo.toml"))
        .expect("server manifest");
    let dependencies = manifest
        .split("\n[")
        .find(|section| section.starts_with("dependencies]"))
        .expect("a [dependencies] section");
    for line in dependencies.lines() {
        assert!(
            !(line.starts_with("gemma4-model") || line.starts_with("candle")),
            "the server depends on `{line}`"
        );
    }
    // Every engine source file is either in front of the seam or one of
    // the CPU executor's own.
    for entry in std::fs::read_dir(&engine).expect("engine src") {
        let name = entry
            .expect("entry")
            .file_name()
            .into_string()
            .expect("name");
        assert!(
            ENGINE_FRONT.contains(&name.as_str())
                || ["cpu_executor.rs", "encoders.rs", "fault.rs"].contains(&name.as_str()),
            "{name}: a new engine file must be placed in front of or behind the seam"
        );
    }
}

/// The check finds what it looks for: the CPU executor names them all.
#[test]
fn the_check_sees_the_cpu_executor_behind_the_seam() {
    let found = offences(&crate_dir("gemma4-engine").join("src/cpu_executor.rs"));
    for word in ["candle_core", "Tensor", "Gemma4"] {
        assert!(
            found.iter().any(|f| f.ends_with(&format!(": {word}"))),
            "{word} not found: {found:?}"
        );
    }
}
