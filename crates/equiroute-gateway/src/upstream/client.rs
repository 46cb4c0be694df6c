//! The HTTP client every HTTP upstream (and the judge) shares: hyper's pooled client over
//! rustls, HTTP/1.1 or HTTP/2 as the provider's TLS handshake chooses, plain HTTP for
//! loopback and private providers.
//!
//! hyper's client directly rather than a higher-level one: the gateway needs no redirects,
//! cookies or proxies, and those layers cost a URL parse or two and a dozen allocations per
//! attempt (measured in `bench/gateway`: about 10% of a proxied request's CPU).

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// The largest provider answer read into memory (a non-streamed answer is one JSON document).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

type Inner =
    hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A pooled HTTP(S) client. Each thread has its own pool (the connections a thread opens
/// are driven by its runtime): with one event loop per thread, a request and the upstream
/// connection it uses never wake another thread.
#[derive(Clone, Debug)]
pub struct HttpClient {
    _private: (),
}

thread_local! {
    static POOL: Inner = build();
}

/// The client: idle connections kept for 90 s, `TCP_NODELAY` on.
fn build() -> Inner {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(https)
}

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::new()
    }
}

impl HttpClient {
    /// A handle on this thread's pool (idle connections kept for 90 s, `TCP_NODELAY` on).
    #[must_use]
    pub fn new() -> HttpClient {
        HttpClient { _private: () }
    }

    /// Sends `req` and waits for the response head (the body is read by the caller).
    ///
    /// # Errors
    /// No connection (refused, DNS, TLS), or the connection broke before the head arrived:
    /// the error and its causes, without the URL.
    pub async fn send(
        &self,
        req: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        // The response future owns what it needs: nothing of the pool is cloned per request.
        POOL.with(|client| client.request(req))
            .await
            .map_err(|e| chain(&e))
    }
}

/// Reads a whole response body, up to [`MAX_BODY_BYTES`].
///
/// # Errors
/// The body broke off or was larger than the limit.
pub async fn read_body(body: hyper::body::Incoming) -> Result<Bytes, String> {
    Limited::new(body, MAX_BODY_BYTES)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(|e| e.to_string())
}

/// An error and its sources, `: `-joined (hyper's own text is only the outermost layer,
/// e.g. "client error (Connect)").
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}
