//! Where outbound webhooks may go. A subscriber chooses the URL, so without a
//! check combee would POST to whatever it can reach — its own loopback, the
//! cloud metadata address, the private network (SSRF). Non-public addresses
//! are refused unless `webhooks.allow_private_targets` is set: when the
//! subscription is made (literal IPs and names that resolve to one), and again
//! at every delivery, where the HTTP client connects only to addresses this
//! module's resolver returned after checking them (DNS may have changed).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use reqwest::{
    Url,
    dns::{Addrs, Name, Resolve, Resolving},
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TargetError {
    #[error("{0}")]
    BadUrl(&'static str),
    #[error("{host} is a non-public address ({addr}); set `webhooks.allow_private_targets` to allow it")]
    Refused { host: String, addr: IpAddr },
    #[error("cannot resolve {0}")]
    Unresolvable(String),
}

/// True for addresses on the public internet: not loopback, private,
/// link-local, unspecified, shared (CGNAT), multicast, broadcast,
/// documentation, benchmarking or reserved ranges.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let s = v6.segments();
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // fc00::/7 unique local
                || (s[0] & 0xffc0) == 0xfe80 // fe80::/10 link-local
                || (s[0] & 0xffc0) == 0xfec0 // fec0::/10 site-local (deprecated)
                || (s[0] == 0x2001 && s[1] == 0x0db8) // 2001:db8::/32 documentation
                || (s[0] == 0x0064 && s[1] == 0xff9b) // 64:ff9b::/96 NAT64 (reaches IPv4 targets)
                || (s[0..6] == [0, 0, 0, 0, 0, 0])) // ::/96 IPv4-compatible
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // 0.0.0.0/8 "this network"
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b)) // 100.64/10 shared address space
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 168)
        || (a == 192 && b == 0 && c == 0) // 192.0.0/24 protocol assignments
        || (a == 192 && b == 0 && c == 2) // documentation
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // documentation
        || (a == 203 && b == 0 && c == 113) // documentation
        || a >= 224) // multicast, reserved, broadcast
}

/// Checks a subscription URL: http(s), a host, no credentials, and — unless
/// `allow_private` — every address it resolves to is public.
pub async fn check_url(raw: &str, allow_private: bool) -> Result<Url, TargetError> {
    let url = Url::parse(raw).map_err(|_| TargetError::BadUrl("`url` is not a valid absolute URL"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(TargetError::BadUrl("`url` must use http or https"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(TargetError::BadUrl("`url` must not carry credentials; the signature authenticates combee"));
    }
    if url.fragment().is_some() {
        return Err(TargetError::BadUrl("`url` must not have a fragment"));
    }
    let host = url.host_str().filter(|h| !h.is_empty()).ok_or(TargetError::BadUrl("`url` has no host"))?.to_owned();
    if allow_private {
        return Ok(url);
    }
    let port = url.port_or_known_default().unwrap_or(80);
    for addr in resolve(&url, port).await? {
        if !is_public(addr.ip()) {
            return Err(TargetError::Refused { host, addr: addr.ip() });
        }
    }
    Ok(url)
}

/// The addresses a URL's host stands for (a literal IP is its own answer).
async fn resolve(url: &Url, port: u16) -> Result<Vec<SocketAddr>, TargetError> {
    let host = url.host_str().unwrap_or_default();
    if let Some(ip) = literal_ip(url) {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let lookup = tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host((host, port)));
    match lookup.await {
        Ok(Ok(addrs)) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            if addrs.is_empty() { Err(TargetError::Unresolvable(host.to_owned())) } else { Ok(addrs) }
        }
        _ => Err(TargetError::Unresolvable(host.to_owned())),
    }
}

/// The host as an IP address when it is one (the URL parser has already
/// normalised forms such as `0x7f.1`; IPv6 hosts come in brackets).
fn literal_ip(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host).parse().ok()
}

/// The delivery-time check for a literal IP host (the resolver never sees those).
pub fn check_literal(url: &Url, allow_private: bool) -> Result<(), TargetError> {
    let Some(ip) = literal_ip(url) else { return Ok(()) };
    if allow_private || is_public(ip) { Ok(()) } else { Err(TargetError::Refused { host: ip.to_string(), addr: ip }) }
}

/// A DNS resolver for the delivery client that returns only public addresses
/// (all of them when private targets are allowed), so the client connects to
/// exactly the addresses that passed the check.
pub struct CheckedResolver {
    pub allow_private: bool,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> =
                addrs.iter().copied().filter(|a| allow_private || is_public(a.ip())).collect();
            if allowed.is_empty() {
                let err: Box<dyn std::error::Error + Send + Sync> = match addrs.first() {
                    Some(a) => Box::new(TargetError::Refused { host, addr: a.ip() }),
                    None => Box::new(TargetError::Unresolvable(host)),
                };
                return Err(err);
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

pub fn resolver(allow_private: bool) -> Arc<CheckedResolver> {
    Arc::new(CheckedResolver { allow_private })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn non_public_ranges_are_refused() {
        for s in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(!is_public(ip(s)), "{s} should be refused");
        }
        for s in ["1.1.1.1", "8.8.8.8", "172.32.0.1", "192.169.0.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(ip(s)), "{s} should be allowed");
        }
    }

    #[tokio::test]
    async fn urls_are_checked_before_anything_is_stored() {
        let refused = check_url("http://127.0.0.1:9/hook", false).await.unwrap_err();
        assert!(matches!(refused, TargetError::Refused { .. }), "{refused}");
        assert!(matches!(check_url("http://[::1]/x", false).await, Err(TargetError::Refused { .. })));
        assert!(matches!(check_url("http://0x7f.1/x", false).await, Err(TargetError::Refused { .. })));
        assert!(matches!(check_url("http://localhost:8080/x", false).await, Err(TargetError::Refused { .. })));
        assert!(matches!(check_url("ftp://example.com/x", false).await, Err(TargetError::BadUrl(_))));
        assert!(matches!(check_url("https://u:p@example.com/x", false).await, Err(TargetError::BadUrl(_))));
        assert!(matches!(check_url("not a url", false).await, Err(TargetError::BadUrl(_))));
        assert!(check_url("http://127.0.0.1:9/hook", true).await.is_ok());
        assert!(check_url("https://1.1.1.1/hook", false).await.is_ok());
    }

    #[test]
    fn literal_addresses_are_checked_at_delivery() {
        let url = Url::parse("http://10.0.0.5/x").unwrap();
        assert!(check_literal(&url, false).is_err());
        assert!(check_literal(&url, true).is_ok());
        assert!(check_literal(&Url::parse("http://example.com/x").unwrap(), false).is_ok());
    }
}
