//! Test support: a `gemma4 serve` process on a free loopback port, a small
//! HTTP/1.1 client over `TcpStream` (with an incremental SSE reader), and a
//! runner for the `openai` Python client script.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(variant: &str) -> PathBuf {
    root().join("tests/fixtures/oracle").join(variant)
}

pub fn golden(variant: &str) -> Value {
    let path = fixture(variant).join("golden.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON in {}: {e}", path.display()))
}

/// A running `gemma4 serve`; killed when dropped.
pub struct ServerProc {
    child: Child,
    pub port: u16,
    log: Arc<Mutex<String>>,
}

impl ServerProc {
    /// Starts the server on a free port and waits until `/ready` says ready.
    pub fn start(model: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gemma4"));
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args);
        cmd.env_remove("GEMMA4_API_KEY").env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn gemma4 serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (port_tx, port_rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let port = rest
                        .split(':')
                        .nth(1)
                        .and_then(|p| p.trim().parse::<u16>().ok());
                    if let Some(p) = port {
                        let _ = port_tx.send(p);
                    }
                }
                if let Ok(mut l) = sink.lock() {
                    l.push_str(&line);
                    l.push('\n');
                }
            }
        });
        let port = match port_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                let text = log.lock().map(|l| l.clone()).unwrap_or_default();
                panic!("server did not report its address:\n{text}");
            }
        };
        let server = Self { child, port, log };
        server.wait_ready();
        server
    }

    fn wait_ready(&self) {
        let until = Instant::now() + Duration::from_secs(120);
        while Instant::now() < until {
            if let Some(r) = try_request(self.port, "GET", "/ready", &[], None) {
                if r.status == 200 {
                    return;
                }
                assert_eq!(r.status, 503, "/ready while loading: {}", r.body);
                assert_eq!(
                    r.json()["status"],
                    "loading",
                    "/ready while loading: {}",
                    r.body
                );
                // Alive while loading: liveness does not restart a slow load.
                let live = try_request(self.port, "GET", "/health", &[], None);
                if let Some(live) = live.filter(|l| l.json()["status"] == "loading") {
                    assert_eq!(live.status, 200, "/health while loading: {}", live.body);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("server not ready within 120 s:\n{}", self.log());
    }

    /// Resident memory of the server process, in KiB (Linux's `VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the server's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < until,
                "server did not exit within {limit:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn get(&self, path: &str) -> Reply {
        request(self.port, "GET", path, &[], None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        request(
            self.port,
            "POST",
            path,
            &[],
            Some(body.to_string().as_bytes()),
        )
    }

    /// A metric's value from `/metrics` (the first sample whose line starts with `prefix`).
    pub fn metric(&self, prefix: &str) -> f64 {
        let text = self.get("/metrics").body;
        metric_in(&text, prefix).unwrap_or_else(|| panic!("no metric {prefix} in\n{text}"))
    }

    /// A metric's value, or 0 while it has no line (a labelled counter
    /// appears with its first count).
    pub fn metric_or_zero(&self, prefix: &str) -> f64 {
        metric_in(&self.get("/metrics").body, prefix).unwrap_or(0.0)
    }

    /// Waits until a metric has `value`: the engine publishes its figures
    /// right after the events it sends, so a scrape can be a step behind.
    pub fn wait_metric(&self, prefix: &str, value: f64, limit: Duration) {
        let until = Instant::now() + limit;
        loop {
            let now = self.metric(prefix);
            if now == value {
                return;
            }
            assert!(
                Instant::now() < until,
                "{prefix} is {now}, expected {value} within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The value on the line of `text` that names the metric `prefix`.
fn metric_in(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix) && l[prefix.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("response is not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn write_request(
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) {
    let body = body.unwrap_or_default();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    // The server may answer (413) and close before reading all of a large body.
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body));
}

fn parse_head(head: &str) -> (u16, Vec<(String, String)>) {
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers)
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&data[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 4 + size).min(data.len())..];
    }
    out
}

/// One request on a fresh connection; `None` if the server cannot be reached.
pub fn try_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Option<Reply> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .ok()?;
    write_request(&mut stream, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let (status, headers) = parse_head(&String::from_utf8_lossy(&raw[..split]));
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Some(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Reply {
    try_request(port, method, path, headers, body)
        .unwrap_or_else(|| panic!("no response to {method} {path}"))
}

/// A streaming (SSE) response read event by event.
pub struct EventStream {
    reader: BufReader<TcpStream>,
    pending: String,
    ended: bool,
}

impl EventStream {
    /// Sends a POST and reads the response head; panics unless it is a 200 event stream.
    pub fn open(port: u16, path: &str, body: &Value) -> Self {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        write_request(
            &mut stream,
            "POST",
            path,
            &[],
            Some(body.to_string().as_bytes()),
        );
        let mut reader = BufReader::new(stream);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).expect("read head") == 0 || line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let (status, headers) = parse_head(head.trim_end());
        assert_eq!(status, 200, "stream refused: {head}");
        assert!(
            headers
                .iter()
                .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")),
            "not an event stream: {head}"
        );
        Self {
            reader,
            pending: String::new(),
            ended: false,
        }
    }

    /// The next event's `data`, or `None` at the end of the body.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            if self.ended {
                return None;
            }
            // One chunk of the chunked body.
            let mut size_line = String::new();
            if self.reader.read_line(&mut size_line).unwrap_or(0) == 0 {
                self.ended = true;
                continue;
            }
            let size = usize::from_str_radix(size_line.trim(), 16).unwrap_or(0);
            if size == 0 {
                self.ended = true;
                continue;
            }
            let mut chunk = vec![0; size + 2];
            self.reader.read_exact(&mut chunk).expect("read chunk");
            self.pending
                .push_str(&String::from_utf8_lossy(&chunk[..size]));
        }
    }

    /// Every remaining event's data.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

/// The demo model (`$GEMMA4_DEMO_GGUF`), required under CI; outside it,
/// `None` with a line saying which test it skips.
pub fn demo_gguf(test: &str) -> Option<PathBuf> {
    let Some(gguf) = std::env::var_os("GEMMA4_DEMO_GGUF") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "GEMMA4_DEMO_GGUF must be set under CI (scripts/test sets it)"
        );
        eprintln!("SKIPPED {test}: set GEMMA4_DEMO_GGUF (see `gemma4 fetch-demo`)");
        return None;
    };
    Some(PathBuf::from(gguf))
}

/// The Python interpreter for the client tests: `$GEMMA4_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("GEMMA4_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Runs `tests/python/openai_client.py` and returns its JSON report, or
/// `None` (with a message) when the `openai` package is missing outside CI.
pub fn openai_client(base_url: &str, args: &[&str]) -> Option<Value> {
    let base_url = format!("{base_url}/v1");
    let mut all = vec!["--base-url", base_url.as_str()];
    all.extend_from_slice(args);
    python_script("openai_client.py", &["openai"], &all)
}

/// Runs `tests/python/SCRIPT` with `args` and returns the JSON object it
/// prints, or `None` (with a message) when one of `modules` cannot be
/// imported outside CI (in CI that fails the test).
pub fn python_script(script: &str, modules: &[&str], args: &[&str]) -> Option<Value> {
    let py = importable(script, modules)?;
    let out = Command::new(&py)
        .arg(root().join("tests/python").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    Some(script_report(script, out))
}

/// The interpreter, when it can import `modules`; otherwise `None` with a
/// message outside CI (in CI that fails the test).
fn importable(script: &str, modules: &[&str]) -> Option<String> {
    let py = python();
    let imports = format!("import {}", modules.join(", "));
    let importable = Command::new(&py)
        .args(["-c", &imports])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !importable {
        let msg = format!(
            "`{imports}` fails with {py}; run scripts/test (it creates .venv) or set GEMMA4_PYTHON"
        );
        if std::env::var_os("CI").is_some() {
            panic!("{msg}");
        }
        eprintln!("SKIPPED {script} checks: {msg}");
        return None;
    }
    Some(py)
}

/// An `openai_client.py` run started ahead of its burst: the interpreter has
/// started, imported the client and said `ready`, and sends its requests
/// when [`ArmedClient::go`] writes a line, so they reach the server within
/// milliseconds of that call rather than after an interpreter's start.
pub struct ArmedClient {
    child: Child,
    stdout: BufReader<std::process::ChildStdout>,
}

/// Starts `openai_client.py` with `--wait-for-go` and waits for its `ready`.
pub fn armed_openai_client(base_url: &str, args: &[&str]) -> Option<ArmedClient> {
    let script = "openai_client.py";
    let py = importable(script, &["openai"])?;
    let mut child = Command::new(&py)
        .arg(root().join("tests/python").join(script))
        .args(["--base-url", &format!("{base_url}/v1"), "--wait-for-go"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    stdout
        .read_line(&mut line)
        .expect("read the client's first line");
    if line.trim() != "ready" {
        let out = child.wait_with_output().expect("wait for the client");
        panic!(
            "{script} did not say ready ({}): {line}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Some(ArmedClient { child, stdout })
}

impl ArmedClient {
    /// Lets the client send and returns the JSON object it prints.
    pub fn go(mut self) -> Value {
        let mut stdin = self.child.stdin.take().expect("piped stdin");
        stdin.write_all(b"go\n").expect("tell the client to go");
        drop(stdin);
        let mut rest = Vec::new();
        self.stdout
            .read_to_end(&mut rest)
            .expect("read the client's report");
        let mut out = self.child.wait_with_output().expect("wait for the client");
        out.stdout = rest;
        script_report("openai_client.py", out)
    }
}

/// The JSON object a client script printed, after checking it succeeded.
fn script_report(script: &str, out: std::process::Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stderr}\n{stdout}",
        out.status
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{script} output is not JSON ({e}): {stdout}\n{stderr}"))
}

/// Checks the OpenAI error shape and returns the error object.
pub fn openai_error(reply: &Reply) -> Value {
    let body = reply.json();
    let err = body
        .get("error")
        .cloned()
        .unwrap_or_else(|| panic!("no `error` in {}", reply.body));
    for key in ["message", "type", "param", "code"] {
        assert!(
            err.get(key).is_some(),
            "error lacks `{key}`: {}",
            reply.body
        );
    }
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "empty message: {}",
        reply.body
    );
    err
}
