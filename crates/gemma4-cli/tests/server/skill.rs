//! The agent skill (`skills/gemma4`, one with `plugins/gemma4/skills/gemma4`)
//! and the Claude Code plugin: the skill's script starts, checks, asks,
//! benchmarks and stops a real server on the demo model; the manifests
//! name each other; the plugin's `.mcp.json` starts `gemma4 mcp`, listed
//! through the official `mcp` SDK.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use crate::harness::{demo_gguf, python_script, root};

fn json_file(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn skill(state: &Path, args: &[&str]) -> Output {
    Command::new("python3")
        .arg(root().join("skills/gemma4/scripts/gemma4_server.py"))
        .args(args)
        .env("GEMMA4_BIN", env!("CARGO_BIN_EXE_gemma4"))
        .env("GEMMA4_SKILL_STATE", state)
        .env_remove("GEMMA4_API_KEY")
        .output()
        .expect("python3 runs the skill's script")
}

fn stdout_of(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_skill_script_runs_a_server_end_to_end() {
    if demo_gguf("the_skill_script_runs_a_server_end_to_end").is_none() {
        return;
    }
    let state = std::env::temp_dir().join(format!("gemma4-skill-{}", std::process::id()));
    let url = stdout_of(&skill(&state, &["start"]), "start");
    assert!(url.trim().starts_with("http://127.0.0.1:"), "{url}");
    let health: Value =
        serde_json::from_str(&stdout_of(&skill(&state, &["health"]), "health")).expect("JSON");
    assert_eq!(health["status"], "ready", "{health}");
    assert_eq!(health["models"][0], "gemma-3-270m-q4_k_m", "{health}");
    let prompt = "Q: What is the capital of France?\nA:";
    let answer = stdout_of(
        &skill(&state, &["chat", "--complete", prompt, "--max-tokens", "8"]),
        "chat",
    );
    assert!(answer.contains("Paris"), "{answer}");
    let bench = ["bench", "--requests", "3", "--concurrency", "1,2"];
    let report = stdout_of(&skill(&state, &bench), "bench");
    let report = json_file(Path::new(report.trim().lines().last().unwrap_or_default()));
    assert!(report.to_string().contains("\"concurrency\":2"), "{report}");
    assert!(stdout_of(&skill(&state, &["stop"]), "stop").contains("stopped"));
    assert!(
        !skill(&state, &["health"]).status.success(),
        "health after stop"
    );
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn the_plugin_manifests_name_the_skill_and_the_mcp_server() {
    let market = json_file(&root().join(".claude-plugin/marketplace.json"));
    let entry = &market["plugins"][0];
    let plugin = root().join(entry["source"].as_str().expect("a source folder"));
    let manifest = json_file(&plugin.join(".claude-plugin/plugin.json"));
    assert_eq!(manifest["name"], entry["name"]);
    let skill = std::fs::read_to_string(plugin.join("skills/gemma4/SKILL.md")).expect("SKILL.md");
    let shared = std::fs::read_to_string(root().join("skills/gemma4/SKILL.md")).expect("SKILL.md");
    assert_eq!(skill, shared, "skills/gemma4 is the plugin's skill");
    let front = skill
        .strip_prefix("---\n")
        .and_then(|rest| rest.split_once("\n---\n"))
        .map(|(front, _)| front)
        .expect("front matter");
    assert!(front.lines().any(|l| l == "name: gemma4"), "{front}");
    assert!(
        front
            .lines()
            .any(|l| l.starts_with("description: ") && l.len() > 40),
        "{front}"
    );
    if demo_gguf("the_plugin_manifests_name_the_skill_and_the_mcp_server").is_none() {
        return;
    }
    let config = plugin.join(".mcp.json");
    let config = config.to_str().expect("utf-8 path");
    let args = ["config", config, env!("CARGO_BIN_EXE_gemma4")];
    let Some(out) = python_script("mcp_client.py", &["mcp"], &args) else {
        return;
    };
    assert_eq!(out["model"], "gemma-3-270m-q4_k_m", "{out}");
}
