//! The HTTP side: one server endpoint, streaming completions timed chunk by
//! chunk, and plain JSON calls for probes and server information.

use std::time::{Duration, Instant};

use reqwest::{Client, Method, RequestBuilder, Url};
use serde_json::Value;

use crate::error::{BenchError, Result};
use crate::sse::{interpret, SseParser, StreamEvent, Usage};

/// Longest server text kept in an error message.
const SNIPPET_CHARS: usize = 200;

/// A server's base URL with a shared connection pool.
#[derive(Debug, Clone)]
pub struct Endpoint {
    base: Url,
    api_key: Option<String>,
    client: Client,
}

/// Why a call did not produce a usable answer.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// No HTTP exchange happened (connection refused, DNS, timeout...).
    Transport(String),
    /// The server answered with a non-success status.
    Status { status: u16, message: String },
    /// The answer was not what the protocol promises.
    Protocol(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Transport(m) => write!(f, "{m}"),
            CallError::Status { status, message } => write!(f, "HTTP {status}: {message}"),
            CallError::Protocol(m) => write!(f, "{m}"),
        }
    }
}

impl Endpoint {
    /// `url` is the server root (`http://host:port`); a trailing `/v1` is
    /// accepted and dropped. Only plain `http` is supported.
    pub fn new(url: &str, api_key: Option<String>, timeout: Duration) -> Result<Self> {
        let invalid = |reason: &str| BenchError::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let mut base = Url::parse(url.trim()).map_err(|e| invalid(&e.to_string()))?;
        match base.scheme() {
            "http" => {}
            "https" => return Err(invalid("https is not supported by this build; use http://")),
            other => {
                return Err(invalid(&format!(
                    "unsupported scheme '{other}'; use http://"
                )))
            }
        }
        if base.host_str().is_none() {
            return Err(invalid("no host"));
        }
        let path = base.path().trim_end_matches('/');
        let path = path.strip_suffix("/v1").unwrap_or(path).to_owned();
        base.set_path(&format!("{path}/"));
        base.set_query(None);
        base.set_fragment(None);
        let client = Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(timeout)
            .pool_max_idle_per_host(usize::MAX)
            .build()
            .map_err(|e| BenchError::Http(error_chain(&e)))?;
        Ok(Endpoint {
            base,
            api_key,
            client,
        })
    }

    /// The URL of `path` (relative, e.g. `v1/completions`) on this server.
    pub fn url(&self, path: &str) -> String {
        self.base
            .join(path.trim_start_matches('/'))
            .map(|u| u.to_string())
            .unwrap_or_else(|_| format!("{}{}", self.base, path.trim_start_matches('/')))
    }

    /// The server root as given (without `/v1`).
    pub fn base(&self) -> String {
        self.base.as_str().trim_end_matches('/').to_owned()
    }

    /// True when the host is a loopback address or `localhost`.
    pub fn is_loopback(&self) -> bool {
        let Some(host) = self.base.host_str() else {
            return false;
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<std::net::IpAddr>() {
            Ok(ip) => ip.is_loopback(),
            Err(_) => bare.eq_ignore_ascii_case("localhost"),
        }
    }

    fn request(&self, method: Method, path: &str, timeout: Option<Duration>) -> RequestBuilder {
        let mut builder = self.client.request(method, self.url(path));
        if let Some(key) = &self.api_key {
            builder = builder.bearer_auth(key);
        }
        if let Some(t) = timeout {
            builder = builder.timeout(t);
        }
        builder
    }

    /// GET `path` and return the body as text.
    pub async fn get_text(
        &self,
        path: &str,
        timeout: Duration,
    ) -> std::result::Result<String, CallError> {
        let response = self
            .request(Method::GET, path, Some(timeout))
            .send()
            .await
            .map_err(|e| CallError::Transport(error_chain(&e)))?;
        read_text(response).await
    }

    /// GET `path` and parse the body as JSON.
    pub async fn get_json(
        &self,
        path: &str,
        timeout: Duration,
    ) -> std::result::Result<Value, CallError> {
        let text = self.get_text(path, timeout).await?;
        serde_json::from_str(&text)
            .map_err(|e| CallError::Protocol(format!("invalid JSON ({e}): {}", snippet(&text))))
    }

    /// POST a JSON body to `path` and parse the JSON answer.
    pub async fn post_json(
        &self,
        path: &str,
        body: &Value,
        timeout: Option<Duration>,
    ) -> std::result::Result<Value, CallError> {
        let response = self
            .request(Method::POST, path, timeout)
            .json(body)
            .send()
            .await
            .map_err(|e| CallError::Transport(error_chain(&e)))?;
        let text = read_text(response).await?;
        serde_json::from_str(&text)
            .map_err(|e| CallError::Protocol(format!("invalid JSON ({e}): {}", snippet(&text))))
    }

    /// Sends a streaming request and times it: when each chunk with generated
    /// text arrived, and the token counts the server reported.
    pub async fn stream(&self, path: &str, body: &Value) -> StreamTiming {
        let start = Instant::now();
        let mut timing = StreamTiming::default();
        let outcome = self.stream_inner(path, body, start, &mut timing).await;
        timing.latency = start.elapsed();
        if let Err(e) = outcome {
            timing.error = Some(e);
        } else if timing.text_chunks == 0
            && timing.usage.and_then(|u| u.completion_tokens).unwrap_or(0) == 0
        {
            timing.error = Some(CallError::Protocol(
                "the stream ended without generating any text".to_owned(),
            ));
        }
        timing
    }

    async fn stream_inner(
        &self,
        path: &str,
        body: &Value,
        start: Instant,
        timing: &mut StreamTiming,
    ) -> std::result::Result<(), CallError> {
        let send = || {
            self.request(Method::POST, path, None)
                .header(reqwest::header::ACCEPT, "text/event-stream")
                .json(body)
                .send()
        };
        // A kept-alive connection the server closed as the request went out is
        // the client's mishap, not a server error: retried once on a fresh one.
        let mut response = match send().await {
            Err(e) if closed_before_any_response(&e) => {
                timing.retried = true;
                send().await
            }
            sent => sent,
        }
        .map_err(|e| CallError::Transport(error_chain(&e)))?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        let mut parser = SseParser::new();
        loop {
            let chunk = response
                .chunk()
                .await
                .map_err(|e| CallError::Transport(format!("stream broken: {}", error_chain(&e))))?;
            let (events, finished) = match chunk {
                Some(bytes) => (parser.feed(&bytes), false),
                None => (parser.finish().into_iter().collect(), true),
            };
            let now = start.elapsed();
            for data in events {
                match interpret(&data).map_err(CallError::Protocol)? {
                    StreamEvent::Done => {
                        timing.saw_done = true;
                        return Ok(());
                    }
                    StreamEvent::Error(message) => {
                        return Err(CallError::Protocol(format!("error in stream: {message}")));
                    }
                    StreamEvent::Chunk { has_text, usage } => {
                        if has_text {
                            timing.text_chunks += 1;
                            timing.chunk_times.push(now);
                        }
                        if usage.is_some() {
                            timing.usage = usage;
                        }
                    }
                }
            }
            if finished {
                return Ok(());
            }
        }
    }
}

/// The timing of one streamed request.
#[derive(Debug, Clone, Default)]
pub struct StreamTiming {
    /// Arrival time (since the request was sent) of each chunk with text.
    pub chunk_times: Vec<Duration>,
    /// Number of chunks that carried generated text.
    pub text_chunks: u32,
    /// The last `usage` the stream carried.
    pub usage: Option<Usage>,
    /// Time until the stream ended.
    pub latency: Duration,
    /// Whether `[DONE]` arrived.
    pub saw_done: bool,
    /// Whether the request was sent a second time because its pooled
    /// connection turned out closed before any byte of response.
    pub retried: bool,
    pub error: Option<CallError>,
}

impl StreamTiming {
    /// Time to the first chunk with text.
    pub fn ttft(&self) -> Option<Duration> {
        self.chunk_times.first().copied()
    }
}

/// Whether `send` failed because the connection closed before a response
/// head arrived (errors once the head is in come from reading the body and
/// are never retried). hyper reports a close after part of a status line the
/// same way as a close before any byte, so that rare case is retried too.
/// Failures to connect and timeouts are not such mishaps.
fn closed_before_any_response(error: &reqwest::Error) -> bool {
    if error.is_connect() || error.is_timeout() || error.status().is_some() {
        return false;
    }
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = source {
        if e.to_string()
            .contains("connection closed before message completed")
        {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            ) {
                return true;
            }
        }
        source = e.source();
    }
    false
}

async fn read_text(response: reqwest::Response) -> std::result::Result<String, CallError> {
    if !response.status().is_success() {
        return Err(status_error(response).await);
    }
    response
        .text()
        .await
        .map_err(|e| CallError::Transport(format!("reading the answer: {}", error_chain(&e))))
}

async fn status_error(response: reqwest::Response) -> CallError {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("error").map(crate::sse::error_message))
        .unwrap_or_else(|| text.clone());
    CallError::Status {
        status,
        message: snippet(&message),
    }
}

/// An error and its causes on one line (reqwest hides the useful part, such as
/// "Connection refused", in the source chain).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        source = e.source();
    }
    parts.join(": ")
}

/// The first characters of a text, on one line.
pub fn snippet(text: &str) -> String {
    let flat: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() > SNIPPET_CHARS {
        let cut: String = flat.chars().take(SNIPPET_CHARS).collect();
        format!("{cut}…")
    } else {
        flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalised() {
        let t = Duration::from_secs(1);
        let e = Endpoint::new("http://127.0.0.1:8000/v1/", None, t).map_err(|e| e.to_string());
        let e = match e {
            Ok(e) => e,
            Err(m) => panic!("{m}"),
        };
        assert_eq!(
            e.url("v1/completions"),
            "http://127.0.0.1:8000/v1/completions"
        );
        assert_eq!(e.url("/tokenize"), "http://127.0.0.1:8000/tokenize");
        assert_eq!(e.base(), "http://127.0.0.1:8000");
        assert!(e.is_loopback());
        let sub = Endpoint::new("http://example.test/proxy", None, t).map_err(|e| e.to_string());
        assert_eq!(
            sub.map(|e| e.url("v1/models")),
            Ok("http://example.test/proxy/v1/models".to_owned())
        );
    }

    #[test]
    fn bad_urls_are_refused() {
        let t = Duration::from_secs(1);
        for bad in [
            "not a url",
            "https://x.test",
            "ftp://x.test",
            "localhost:8000",
        ] {
            assert!(Endpoint::new(bad, None, t).is_err(), "{bad}");
        }
    }

    #[test]
    fn snippets_are_short_and_flat() {
        assert_eq!(snippet(" a\nb "), "a b");
        let long = "x".repeat(500);
        assert_eq!(snippet(&long).chars().count(), SNIPPET_CHARS + 1);
    }
}
