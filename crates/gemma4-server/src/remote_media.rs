//! Images by http(s) URL, fetched only when the server was started with
//! `--allow-remote-media`: each fetch is bounded in time (connecting and the
//! whole transfer), in size (the declared length is checked first, then the
//! bytes as they arrive) and in redirects. A fetched image becomes a `data:`
//! URI, so it is then decoded and encoded as a sent one would be.

use std::time::Duration;

use base64::Engine as _;

use crate::error::ApiError;
use crate::openai::request::{MediaKind, MediaPart};

/// The bounds of every fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMediaLimits {
    /// The whole fetch, from connecting to the last byte.
    pub timeout: Duration,
    pub max_bytes: usize,
    pub max_redirects: usize,
}

impl Default for RemoteMediaLimits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_bytes: 20 << 20,
            max_redirects: 3,
        }
    }
}

/// Fetches images by URL within [`RemoteMediaLimits`].
pub struct RemoteMedia {
    client: reqwest::Client,
    limits: RemoteMediaLimits,
}

impl RemoteMedia {
    pub fn new(limits: RemoteMediaLimits) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(limits.timeout)
            .connect_timeout(limits.timeout)
            .redirect(reqwest::redirect::Policy::limited(limits.max_redirects))
            .user_agent(concat!("gemma4/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build the media fetcher: {e}"))?;
        Ok(Self { client, limits })
    }

    pub fn limits(&self) -> RemoteMediaLimits {
        self.limits
    }

    /// Replaces every http(s) image or video URL of `parts` by a `data:` URI
    /// of the fetched bytes; a failed fetch is a 400 naming the part.
    pub async fn fetch_all(&self, parts: &mut [MediaPart]) -> Result<(), ApiError> {
        for part in parts.iter_mut().filter(|p| p.kind != MediaKind::Audio) {
            if !is_remote(&part.data) {
                continue;
            }
            let bytes = self
                .fetch(&part.data, part.kind.noun())
                .await
                .map_err(|why| {
                    ApiError::bad_request(format!("`{}`: {why}", part.param))
                        .with_param(part.param.clone())
                })?;
            part.data = format!(
                "data:application/octet-stream;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(bytes)
            );
        }
        Ok(())
    }

    async fn fetch(&self, url: &str, what: &str) -> Result<Vec<u8>, String> {
        let limits = self.limits;
        let seconds = limits.timeout.as_secs_f64();
        let failed = |e: reqwest::Error| {
            if e.is_timeout() {
                format!("the {what} did not arrive within {seconds} s")
            } else if e.is_redirect() {
                format!(
                    "fetching the {what} took more than {} redirects",
                    limits.max_redirects
                )
            } else if e.is_builder() {
                format!("not a URL the server can fetch: {e}")
            } else {
                format!("the {what} could not be fetched: {e}")
            }
        };
        let mut response = self.client.get(url).send().await.map_err(failed)?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("fetching the {what} answered HTTP {status}"));
        }
        let too_large = |n: u64| {
            format!(
                "the {what} is {n} bytes or more; at most {} are fetched",
                limits.max_bytes
            )
        };
        if let Some(n) = response.content_length() {
            if n > limits.max_bytes as u64 {
                return Err(too_large(n));
            }
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            if bytes.len() + chunk.len() > limits.max_bytes {
                return Err(too_large((bytes.len() + chunk.len()) as u64));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }
}

/// Whether an image URL is fetched over the network.
pub fn is_remote(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}
