//! Images by http(s) URL, fetched only when the server was started with
//! `--allow-remote-media`: each fetch is bounded in time (connecting and the
//! whole transfer), in size (the declared length is checked first, then the
//! bytes as they arrive) and in redirects. A fetched image becomes a `data:`
//! URI, so it is then decoded and encoded as a sent one would be.
//!
//! A URL is a request the server makes on a client's behalf, so it must not
//! reach what only the server can reach (its own loopback, the pod network,
//! a cloud's metadata address). [`HostPolicy`] refuses every address that
//! is not public: an address written in the URL before any connection, a
//! name after it resolves (the connection then uses exactly the addresses
//! that were checked, so a second lookup cannot swap them), and the target
//! of every redirect again.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

use crate::error::ApiError;
use crate::openai::request::{MediaKind, MediaPart};

/// The bounds of every fetch, and of all the fetches of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMediaLimits {
    /// The whole fetch, from connecting to the last byte.
    pub timeout: Duration,
    pub max_bytes: usize,
    pub max_redirects: usize,
    /// All of one request's fetches, from the first connection to the last byte.
    pub request_timeout: Duration,
    /// Bytes fetched for one request, over all its parts.
    pub max_request_bytes: usize,
}

impl Default for RemoteMediaLimits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_bytes: 20 << 20,
            max_redirects: 3,
            request_timeout: Duration::from_secs(20),
            max_request_bytes: 32 << 20,
        }
    }
}

/// Which hosts a media URL may name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// When set, only these hosts (names or addresses, compared without
    /// case) are fetched, at whatever address they resolve to: an operator
    /// who lists an internal media host means it.
    pub allowed_domains: Option<Vec<String>>,
    /// Fetch from any address, loopback and private ones included (for tests
    /// against a local server; never on a server others can reach).
    pub allow_private: bool,
}

impl HostPolicy {
    /// Whether `host` is on the operator's list.
    fn listed(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.allowed_domains
            .as_ref()
            .is_some_and(|list| list.iter().any(|d| d.eq_ignore_ascii_case(host)))
    }

    /// Whether the addresses of `host` need not be public.
    fn trusts(&self, host: &str) -> bool {
        self.allow_private || self.listed(host)
    }

    /// Checks a URL before it is fetched (the first one and every redirect):
    /// its scheme, the list, and an address written in it. A name's
    /// addresses are checked when it resolves.
    fn check_url(&self, url: &Url) -> Result<(), String> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "`{}:` URLs are not fetched; use http(s)",
                url.scheme()
            ));
        }
        let Some(host) = url.host_str() else {
            return Err("the URL names no host".into());
        };
        if self.allowed_domains.is_some() && !self.listed(host) {
            return Err(format!(
                "the host `{host}` is not one of --allowed-media-domains"
            ));
        }
        let literal = match url.host() {
            Some(url::Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
            _ => None,
        };
        match literal {
            Some(ip) if !self.trusts(host) => check_public(host, ip),
            _ => Ok(()),
        }
    }
}

/// Why a URL was not fetched, carried through reqwest's errors so the reply
/// can say it plainly.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The refusal somewhere in `error`'s chain of causes, if one is there.
fn refusal(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(r) = e.downcast_ref::<Refused>() {
            return Some(r.0.clone());
        }
        cause = e.source();
    }
    None
}

/// The kind of address `ip` is, when it is not a public one.
pub fn non_public_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_kind(v4),
        IpAddr::V6(v6) => v6_kind(v6),
    }
}

fn v4_kind(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, ..) => "unspecified (0.0.0.0/8)",
        (127, ..) => "loopback",
        (10, ..) => "private (10.0.0.0/8)",
        (172, 16..=31, _) => "private (172.16.0.0/12)",
        (192, 168, _) => "private (192.168.0.0/16)",
        (169, 254, _) => "link-local",
        (100, 64..=127, _) => "shared (100.64.0.0/10, carrier-grade NAT)",
        (192, 0, 0) => "reserved for protocol assignments (192.0.0.0/24)",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "reserved for documentation",
        (198, 18..=19, _) => "reserved for benchmarking (198.18.0.0/15)",
        (224..=239, ..) => "multicast",
        (240..=255, ..) => "reserved or broadcast",
        _ => return None,
    })
}

fn v6_kind(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    // Addresses that carry an IPv4 address are what that address is.
    let embedded =
        |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return v4_kind(v4);
    }
    Some(match s {
        [0, 0, 0, 0, 0, 0, 0, 0] => "unspecified",
        [0, 0, 0, 0, 0, 0, 0, 1] => "loopback",
        // The deprecated IPv4-compatible form has no public use.
        [0, 0, 0, 0, 0, 0, _, _] => "IPv4-compatible (deprecated)",
        // NAT64 and 6to4 reach the IPv4 address they carry.
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] | [0x2002, hi, lo, ..] => {
            return v4_kind(embedded(hi, lo));
        }
        [a, ..] if a & 0xfe00 == 0xfc00 => "private (unique local, fc00::/7)",
        [a, ..] if a & 0xffc0 == 0xfe80 => "link-local",
        [a, ..] if a & 0xffc0 == 0xfec0 => "site-local",
        [a, ..] if a & 0xff00 == 0xff00 => "multicast",
        [0x2001, 0xdb8, ..] => "reserved for documentation",
        _ => return None,
    })
}

fn check_public(host: &str, ip: IpAddr) -> Result<(), String> {
    match non_public_kind(ip) {
        None => Ok(()),
        Some(kind) => {
            let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
                "an"
            } else {
                "a"
            };
            Err(format!(
                "the host `{host}` is {ip}, {article} {kind} address; media are fetched only from public addresses (list a trusted host in --allowed-media-domains)"
            ))
        }
    }
}

/// Resolves names for the fetcher and refuses any whose addresses are not
/// all public; the connection is made to the addresses returned here.
struct GuardedResolver {
    policy: Arc<HostPolicy>,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if !policy.trusts(&host) {
                for addr in &addrs {
                    check_public(&host, addr.ip()).map_err(Refused)?;
                }
            }
            let addrs: Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

/// Fetches images by URL within [`RemoteMediaLimits`], from the hosts
/// [`HostPolicy`] allows.
pub struct RemoteMedia {
    client: reqwest::Client,
    limits: RemoteMediaLimits,
    policy: Arc<HostPolicy>,
}

impl RemoteMedia {
    pub fn new(limits: RemoteMediaLimits, policy: HostPolicy) -> Result<Self, String> {
        let policy = Arc::new(policy);
        let redirects = policy.clone();
        let max_redirects = limits.max_redirects;
        let client = reqwest::Client::builder()
            .timeout(limits.timeout)
            .connect_timeout(limits.timeout)
            // A proxy would resolve names itself, past the resolver's check.
            .no_proxy()
            .dns_resolver(Arc::new(GuardedResolver {
                policy: policy.clone(),
            }))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() > max_redirects {
                    let why = format!("more than {max_redirects} redirects");
                    return attempt.error(Refused(why));
                }
                match redirects.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(why) => attempt.error(Refused(format!("a redirect was refused: {why}"))),
                }
            }))
            .user_agent(concat!("gemma4/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build the media fetcher: {e}"))?;
        Ok(Self {
            client,
            limits,
            policy,
        })
    }

    pub fn limits(&self) -> RemoteMediaLimits {
        self.limits
    }

    pub fn policy(&self) -> &HostPolicy {
        &self.policy
    }

    /// Replaces every http(s) image or video URL of `parts` by a `data:` URI
    /// of the fetched bytes, within the per-request bounds as well as each
    /// fetch's own; a failed fetch is a 400 naming the part.
    pub async fn fetch_all(&self, parts: &mut [MediaPart]) -> Result<(), ApiError> {
        let limits = self.limits;
        let deadline = tokio::time::Instant::now() + limits.request_timeout;
        let mut fetched = 0;
        for part in parts.iter_mut().filter(|p| p.kind != MediaKind::Audio) {
            if !is_remote(&part.data) {
                continue;
            }
            let left = limits.max_request_bytes.saturating_sub(fetched);
            let fetch = self.fetch(&part.data, part.kind.noun(), left);
            let fetched_part = match tokio::time::timeout_at(deadline, fetch).await {
                Ok(result) => result,
                Err(_) => Err(format!(
                    "the request's media did not all arrive within {} s (--media-request-timeout)",
                    limits.request_timeout.as_secs_f64()
                )),
            };
            let bytes = fetched_part.map_err(|why| {
                ApiError::bad_request(format!("`{}`: {why}", part.param))
                    .with_param(part.param.clone())
            })?;
            fetched += bytes.len();
            part.data = format!(
                "data:application/octet-stream;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(bytes)
            );
        }
        Ok(())
    }

    /// One fetch, of at most `--max-media-bytes` and of the `left` bytes the
    /// request's budget still allows.
    async fn fetch(&self, url: &str, what: &str, left: usize) -> Result<Vec<u8>, String> {
        let limits = self.limits;
        let seconds = limits.timeout.as_secs_f64();
        let parsed = Url::parse(url).map_err(|e| format!("not a URL the server can fetch: {e}"))?;
        self.policy.check_url(&parsed)?;
        let failed = |e: reqwest::Error| {
            if let Some(why) = refusal(&e) {
                format!("the {what} was not fetched: {why}")
            } else if e.is_timeout() {
                format!("the {what} did not arrive within {seconds} s")
            } else if e.is_builder() {
                format!("not a URL the server can fetch: {e}")
            } else {
                format!("the {what} could not be fetched: {e}")
            }
        };
        let mut response = self.client.get(parsed).send().await.map_err(failed)?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("fetching the {what} answered HTTP {status}"));
        }
        let cap = limits.max_bytes.min(left);
        let too_large = |n: u64| {
            if n <= limits.max_bytes as u64 {
                format!(
                    "the {what} is {n} bytes or more, past what is left of the {} bytes fetched for one request (--max-media-bytes-per-request)",
                    limits.max_request_bytes
                )
            } else {
                format!(
                    "the {what} is {n} bytes or more; at most {} are fetched (--max-media-bytes)",
                    limits.max_bytes
                )
            }
        };
        if let Some(n) = response.content_length() {
            if n > cap as u64 {
                return Err(too_large(n));
            }
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            if bytes.len() + chunk.len() > cap {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(ip: &str) -> Option<&'static str> {
        non_public_kind(ip.parse().expect("an address"))
    }

    #[test]
    fn addresses_only_the_server_reaches_are_not_public() {
        for ip in [
            "127.0.0.1",
            "127.1.2.3",
            "0.0.0.0",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "2001:db8::1",
        ] {
            assert!(kind(ip).is_some(), "{ip} passed as public");
        }
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "192.169.0.1",
            "100.128.0.1",
            "2606:4700:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
        ] {
            assert_eq!(kind(ip), None, "{ip} refused as not public");
        }
        assert_eq!(kind("169.254.169.254"), Some("link-local"));
    }

    fn check(policy: &HostPolicy, url: &str) -> Result<(), String> {
        policy.check_url(&Url::parse(url).expect("a URL"))
    }

    #[test]
    fn urls_are_checked_before_any_connection() {
        let open = HostPolicy::default();
        // 2130706433 and 0x7f.1 are 127.0.0.1 written other ways.
        for url in [
            "http://127.0.0.1:8000/a.png",
            "http://2130706433/a.png",
            "http://0x7f.1/a.png",
            "http://[::1]/a.png",
            "http://169.254.169.254/latest/meta-data",
            "http://[::ffff:a9fe:a9fe]/",
        ] {
            let e = check(&open, url).expect_err(url);
            assert!(e.contains("public addresses"), "{url}: {e}");
        }
        assert!(check(&open, "http://127.0.0.1/")
            .is_err_and(|e| e.contains("`127.0.0.1` is 127.0.0.1, a loopback address")));
        assert!(check(&open, "ftp://example.com/a.png").is_err_and(|e| e.contains("`ftp:`")));
        // Names pass here; their addresses are checked when they resolve.
        assert_eq!(check(&open, "https://example.com/a.png"), Ok(()));
        assert_eq!(check(&open, "http://localhost/a.png"), Ok(()));

        let listed = HostPolicy {
            allowed_domains: Some(vec!["Media.Internal".into(), "10.0.0.5".into()]),
            allow_private: false,
        };
        assert_eq!(check(&listed, "http://media.internal/a.png"), Ok(()));
        assert_eq!(check(&listed, "http://10.0.0.5/a.png"), Ok(()));
        assert!(check(&listed, "https://example.com/a.png")
            .is_err_and(|e| e.contains("not one of --allowed-media-domains")));
        let private = HostPolicy {
            allowed_domains: None,
            allow_private: true,
        };
        assert_eq!(check(&private, "http://127.0.0.1/a.png"), Ok(()));
    }
}
