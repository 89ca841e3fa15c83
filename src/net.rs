//! Outbound HTTP rules shared by the API client and the driver download.
//!
//! Proxies come from the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, as
//! reqwest reads them), except for loopback: like Go's `net/http`, which kubectl, the kubelet
//! and NVIDIA's tools use, a request to `localhost` or a loopback address always goes direct.
//! A node behind a corporate proxy still reaches a local API server endpoint or a local mirror,
//! and a proxy can never answer for a port on the node itself.

use std::net::IpAddr;

/// Whether the URL's host is `localhost` or a loopback address (127.0.0.0/8, `::1`).
/// A URL that does not parse is not loopback.
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(url) else {
        return false;
    };
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The builder, told to ignore the environment's proxies when `url` is on loopback.
pub fn direct_to_loopback(builder: reqwest::ClientBuilder, url: &str) -> reqwest::ClientBuilder {
    if is_loopback_url(url) {
        builder.no_proxy()
    } else {
        builder
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for url in [
            "http://127.0.0.1:6443",
            "https://127.9.9.9/x",
            "https://[::1]:6443",
            "https://localhost:6443",
            "https://LOCALHOST",
        ] {
            assert!(is_loopback_url(url), "{url}");
        }
        for url in [
            "https://10.0.0.1:6443",
            "https://api.example.com",
            "https://localhost.example.com",
            "https://[::2]",
            "not a url",
            "file:///tmp/x",
        ] {
            assert!(!is_loopback_url(url), "{url}");
        }
    }
}
