//! `gemma4 bench` end to end: argument errors, an unreachable server, and a
//! real sweep against `gemma4 serve` on the small E-style fixture.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use gemma4_bench::schema::validate_report;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gemma4");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gemma4-cli-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("creating {}: {e}", dir.display());
    }
    dir
}

fn free_port() -> u16 {
    match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => panic!("finding a free port: {e}"),
    }
}

fn gemma4(args: &[&str]) -> Output {
    match Command::new(BIN).args(args).stdin(Stdio::null()).output() {
        Ok(o) => o,
        Err(e) => panic!("running {BIN}: {e}"),
    }
}

fn read_report(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let value: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
    if let Err(e) = validate_report(&value) {
        panic!("{} does not validate: {e}", path.display());
    }
    value
}

/// Every level's completed + errors equals the prompts per level, and every
/// request's TTFT is within its latency.
fn check_counts(report: &Value, num_prompts: u64) {
    let sweep = report["throughput"]["sweep"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!sweep.is_empty(), "no sweep rows");
    for row in &sweep {
        let completed = row["completed"].as_u64().unwrap_or(u64::MAX);
        let errors = row["errors"].as_u64().unwrap_or(u64::MAX);
        assert_eq!(completed + errors, num_prompts, "row {row}");
        let requests = row["requests"].as_array().cloned().unwrap_or_default();
        assert_eq!(requests.len() as u64, num_prompts);
        for r in &requests {
            if let (Some(ttft), Some(latency)) = (r["ttft_ms"].as_f64(), r["latency_ms"].as_f64()) {
                assert!(ttft <= latency, "TTFT {ttft} > latency {latency}");
            }
        }
    }
}

#[test]
fn a_malformed_concurrency_list_is_a_clear_error() {
    let out = gemma4(&[
        "bench",
        "serve",
        "--url",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--concurrency",
        "1,x,8",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--concurrency"), "{stderr}");
    assert!(stderr.contains("'x' is not a positive integer"), "{stderr}");
}

#[test]
fn an_unreachable_server_gives_a_report_of_errors() {
    let dir = temp_dir("unreachable");
    let out_path = dir.join("report.json");
    let url = format!("http://127.0.0.1:{}", free_port());
    let out = gemma4(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--model",
        "m",
        "--concurrency",
        "1,2",
        "--num-prompts",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--warmup",
        "0",
        "--no-progress",
        "--out",
        out_path.to_str().unwrap_or_default(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no request to"), "{stderr}");
    let report = read_report(&out_path);
    check_counts(&report, 3);
    for row in report["throughput"]["sweep"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        assert_eq!(row["errors"], 3);
    }
    assert!(dir.join("report.throughput.svg").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_prints_ratios() {
    let example = workspace().join("tests/fixtures/bench/report-example.json");
    let example = example.to_str().unwrap_or_default();
    let out = gemma4(&["bench", "compare", example, example]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("| 8 | output tok/s | 1209 | 1209 | 1.00× | = |"),
        "{stdout}"
    );
    let missing = gemma4(&["bench", "compare", example, "/nonexistent/report.json"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/report.json"));
}

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain GET over loopback: the status code and the body.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split_whitespace().nth(1)?.parse().ok()?;
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

fn health_ok(port: u16) -> bool {
    matches!(http_get(port, "/ready"), Some((200, _)))
}

/// `gemma4 serve` on `model`, healthy, with its port and served model name.
fn start_server(model: &Path) -> (Server, u16, String) {
    let port = free_port();
    let child = Command::new(BIN)
        .args([
            "serve",
            "--model",
            model.to_str().unwrap_or_default(),
            "--port",
            &port.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn();
    let mut server = match child {
        Ok(c) => Server(c),
        Err(e) => panic!("starting gemma4 serve: {e}"),
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    while !health_ok(port) {
        if let Ok(Some(status)) = server.0.try_wait() {
            panic!("gemma4 serve exited with {status} before /ready answered 200");
        }
        assert!(
            Instant::now() < deadline,
            "gemma4 serve did not become healthy in time"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let models = http_get(port, "/v1/models")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let models: Value =
        serde_json::from_str(&models).unwrap_or_else(|e| panic!("GET /v1/models: {e}: {models}"));
    let served = models["data"][0]["id"]
        .as_str()
        .unwrap_or("gemma4")
        .to_owned();
    (server, port, served)
}

#[test]
fn sweep_against_gemma4_serve() {
    let model = workspace().join("tests/fixtures/oracle/e-style");
    let (server, port, served) = start_server(&model);

    let dir = temp_dir("serve");
    let out_path = dir.join("ours.json");
    let url = format!("http://127.0.0.1:{port}");
    let out = gemma4(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--model",
        &served,
        "--concurrency",
        "1,2",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--warmup",
        "1",
        "--tokenizer",
        model.to_str().unwrap_or_default(),
        "--no-progress",
        "--out",
        out_path.to_str().unwrap_or_default(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report = read_report(&out_path);
    check_counts(&report, 4);
    for row in report["throughput"]["sweep"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        assert_eq!(row["completed"], 4, "{row}");
        assert!(
            row["output_tok_per_s"].as_f64().is_some_and(|t| t > 0.0),
            "{row}"
        );
        for r in row["requests"].as_array().cloned().unwrap_or_default() {
            assert_eq!(
                r["input_tokens"], 16,
                "prompts are exactly --input-len tokens: {r}"
            );
            assert_eq!(
                r["output_tokens"], 8,
                "ignore_eos keeps every request at the full length: {r}"
            );
        }
    }
    assert_eq!(report["throughput"]["workload"]["prompt_len_exact"], true);
    assert_eq!(report["software"]["engine"], "gemma4");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The probes against our server on a random model: every probe is judged,
/// and enforcement leaves the structured-output probes few outcomes: a valid
/// ticket for a schema (any bare object for `json_object`), or an answer cut
/// off by `max_tokens` inside the JSON.
#[test]
fn probes_against_gemma4_serve() {
    let model = workspace().join("tests/fixtures/oracle/e-style");
    let (server, port, served) = start_server(&model);
    let dir = temp_dir("probes");
    let out_path = dir.join("probes.json");
    let url = format!("http://127.0.0.1:{port}");
    let out = gemma4(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--model",
        &served,
        "--concurrency",
        "1",
        "--num-prompts",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "2",
        "--warmup",
        "0",
        "--tokenizer",
        model.to_str().unwrap_or_default(),
        "--probes",
        "--no-progress",
        "--out",
        out_path.to_str().unwrap_or_default(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report = read_report(&out_path);
    let capabilities = report["capabilities"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let domains: Vec<&str> = capabilities
        .iter()
        .filter_map(|c| c["domain"].as_str())
        .collect();
    assert_eq!(domains, ["tool_calling", "structured_output", "reasoning"]);
    for c in &capabilities {
        for p in c["probes"].as_array().cloned().unwrap_or_default() {
            let observed = p["observed"].as_str().unwrap_or_default();
            assert!(!observed.is_empty(), "{p}");
            assert!(
                !observed.contains("HTTP"),
                "our server answers every probe: {p}"
            );
            if c["domain"] == "structured_output" {
                let any_object = p["name"] == "json_object-thinking-off"
                    && p["verdict"] == "partial"
                    && observed.starts_with("bare JSON");
                assert!(
                    p["verdict"] == "pass" || any_object || observed.contains("max_tokens ran out"),
                    "enforced output is valid or cut off: {p}"
                );
            }
        }
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench local --bandwidth` judges generation against the memory's rate
/// measured in the same process: the roofline is the larger rate over the
/// bytes a step reads, and the fraction is the generation rate over it.
#[test]
fn local_bench_reports_generation_against_the_measured_bandwidth() {
    let model = workspace().join("tests/fixtures/oracle/e-style");
    let model = model.to_string_lossy();
    let out = gemma4(&[
        "--threads",
        "2",
        "bench",
        "local",
        "--model",
        &model,
        "-p",
        "4",
        "-n",
        "4",
        "-r",
        "1",
        "--bandwidth",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"));
    let roof = &report["roofline"];
    let rates: Vec<f64> = roof["bandwidth_gb_s"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    assert_eq!(rates.len(), 2, "{roof}");
    assert!(rates.iter().all(|&r| r.is_finite() && r > 0.0), "{roof}");
    let bytes = roof["bytes_per_token"].as_f64().unwrap_or(0.0);
    assert!(bytes > 0.0, "{roof}");
    let tok_s = roof["roofline_tok_s"].as_f64().unwrap_or(0.0);
    let larger = rates[0].max(rates[1]) * 1e9;
    assert!((tok_s - larger / bytes).abs() <= 1e-9 * tok_s, "{roof}");
    let tg = report["tests"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["test"] == "tg4"))
        .and_then(|t| t["mean"].as_f64())
        .unwrap_or(0.0);
    let fraction = roof["fraction"].as_f64().unwrap_or(0.0);
    assert!(
        tg > 0.0 && (fraction - tg / tok_s).abs() <= 1e-9 * fraction,
        "{report}"
    );

    // Nothing generated, nothing to judge: refused before loading.
    let out = gemma4(&[
        "bench",
        "local",
        "--model",
        &model,
        "-n",
        "0",
        "--bandwidth",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--bandwidth"), "{stderr}");
}
