//! The executor seam holds: the engine's scheduler, KV manager, loop and
//! request API, and the whole server crate, name no tensor library, tensor
//! or model type. Only the executors behind the seam do.

use std::path::{Path, PathBuf};

/// Identifiers that belong behind the seam.
const BEHIND_THE_SEAM: &[&str] = &["candle_core", "candle", "Tensor", "Gemma4"];

/// Engine files in front of the seam.
const ENGINE_FRONT: &[&str] = &[
    "api.rs",
    "block_hash.rs",
    "engine.rs",
    "executor.rs",
    "kv_manager.rs",
    "lib.rs",
    "output_processor.rs",
    "sampler.rs",
    "scheduler.rs",
    "threaded_executor.rs",
];

fn crate_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name)
}

/// `file:line: identifier` for each identifier of `BEHIND_THE_SEAM` in the
/// file's code (comments included: a doc link names a type too).
fn offences(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("source file");
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for word in line.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if BEHIND_THE_SEAM.contains(&word) {
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
    let mut files: Vec<PathBuf> = ENGINE_FRONT.iter().map(|f| engine.join(f)).collect();
    rust_files(&crate_dir("gemma4-server").join("src"), &mut files);
    let found: Vec<String> = files.iter().flat_map(|f| offences(f)).collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
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
                || ["cpu_executor.rs", "fault.rs"].contains(&name.as_str()),
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
