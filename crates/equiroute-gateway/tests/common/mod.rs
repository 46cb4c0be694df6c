//! Helpers shared by the gateway's integration tests: a gateway and mock upstreams on
//! loopback ports, and a minimal HTTP/1.1 client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use equiroute_gateway::config::load;
use serde_json::Value;
use std::fmt::Write as _;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running gateway; dropped at the end of the test with its runtime.
pub struct Gateway {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

pub async fn start(config: &str, env: &[(&str, &str)]) -> Gateway {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let cfg = load(config, "test.toml", &move |name| {
        env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        equiroute_gateway::serve(&cfg, listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    Gateway {
        addr,
        stop: Some(tx),
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// `(status, x-equiroute-provider, x-equiroute-attempts)`: who answered, after how many.
    pub fn routed(&self) -> (u16, Option<&str>, Option<&str>) {
        (
            self.status,
            self.header("x-equiroute-provider"),
            self.header("x-equiroute-attempts"),
        )
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// A minimal HTTP/1.1 client: one request per connection.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("content-type: application/json\r\n");
    }
    for (k, v) in headers {
        let _ = write!(req, "{k}: {v}\r\n");
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// A chat interface (`[server]` lines first, if any) whose first provider (the table lines
/// `first`, of any kind, id `first`) falls back to an OpenAI one (id `backup`, model
/// `gpt-backup`) at `backup`.
pub fn fallback_config(server: &str, first: &str, backup: SocketAddr) -> String {
    format!(
        r#"
{server}
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "first" }}
deadline_ms = 5000

[[interfaces.chat.providers]]
id = "first"
{first}

[[interfaces.chat.providers]]
id = "backup"
kind = "openai"
model = "gpt-backup"
base_url = "http://{backup}/v1"
"#
    )
}

/// A mock upstream with `profile` (TOML) on a free loopback port.
pub async fn mock(profile: &str) -> Gateway {
    let profile = equiroute_mock::MockProfile::from_toml(profile, "mock.toml").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        equiroute_mock::serve(profile, listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    Gateway {
        addr,
        stop: Some(tx),
    }
}

/// Serves `app` (a test's own upstream or collector) on a free loopback port.
pub async fn serve_app(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The crate's Rust sources, each with its path under `src/` and its code without the unit
/// tests (everything from the first `#[cfg(test)]` on).
pub fn sources() -> Vec<(std::path::PathBuf, String)> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().map(Result::unwrap) {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let code = if path.file_name().is_some_and(|n| n == "tests.rs") {
                    // A module's unit tests in a file of their own (`#[cfg(test)] mod tests;`).
                    String::new()
                } else {
                    text.split("#[cfg(test)]").next().unwrap_or("").to_owned()
                };
                out.push((path.strip_prefix(&src).unwrap().to_path_buf(), code));
            }
        }
    }
    out
}

/// How many calls the mock upstream at `addr` received for `model` (its `/_stats`).
pub async fn calls(addr: SocketAddr, model: &str) -> u64 {
    http(addr, "GET", "/_stats", &[], "").await.json()["models"][model]
        .as_u64()
        .unwrap_or(0)
}

/// A client that sends a streamed chat request to `gw` on a socket with a 4 KiB receive
/// buffer, reads the answer's first bytes (a 200) and then stops reading: the socket, kept
/// open by the caller.
#[allow(dead_code)]
pub async fn stalled_reader(gw: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(gw).await.unwrap();
    let body = r#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = [0u8; 64];
    let n = s.read(&mut head).await.unwrap();
    assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &head[..n]);
    s
}

/// The streams the mock at `addr` has open (`/_stats`).
#[allow(dead_code)]
pub async fn streams_open(addr: SocketAddr) -> u64 {
    http(addr, "GET", "/_stats", &[], "").await.json()["streams_open"]
        .as_u64()
        .unwrap()
}

/// The audit record of request `id` in the log at `path`, once the writer has written it
/// (waits at most 5 s).
pub async fn audit_record(path: &std::path::Path, id: &str) -> Value {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        // Whole lines only: the writer may be halfway through the last one.
        let written = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        if let Some(r) = written
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|r| r["request_id"] == id)
        {
            return r;
        }
        assert!(
            std::time::Instant::now() < until,
            "no audit record for {id}: {text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Runs a gateway until `work` is done, then stops it and waits for its final snapshot.
pub async fn serve_until<F, Fut>(text: &str, work: F) -> std::io::Result<()>
where
    F: FnOnce(std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let cfg = load(text, "test.toml", &|_| None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        equiroute_gateway::serve(&cfg, listener, async {
            let _ = rx.await;
        })
        .await
    });
    // A gateway that refused its state file has already ended.
    if server.is_finished() {
        return server.await.unwrap();
    }
    work(addr).await;
    let _ = tx.send(());
    server.await.unwrap()
}

/// The value of the sample `series` (its name and labels, as `/metrics` writes them) in the
/// exposition `text`; 0 when absent.
pub fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// [`metric`] of the gateway at `addr`, scraped now.
pub async fn scraped(addr: SocketAddr, series: &str) -> u64 {
    metric(&http(addr, "GET", "/metrics", &[], "").await.body, series)
}

/// Log lines written into a shared buffer (a `tracing_subscriber` writer).
#[derive(Clone, Default)]
pub struct Lines(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Lines {
    /// Captures what this thread logs at `level` and above, until the guard is dropped
    /// (a test's gateway runs on its thread).
    pub fn capture(level: tracing::Level) -> (Lines, tracing::subscriber::DefaultGuard) {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(level)
            .with_ansi(false)
            .finish();
        (lines, tracing::subscriber::set_default(subscriber))
    }
}

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// The text of a relayed stream: every chunk's `delta.content`, in order; and the
/// `equiroute` members of its marker events.
pub fn streamed_text(body: &str) -> (String, Vec<Value>) {
    let (mut text, mut markers) = (String::new(), Vec::new());
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if let Some(m) = chunk.get("equiroute") {
            markers.push(m.clone());
        }
        for c in chunk["choices"].as_array().into_iter().flatten() {
            text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        }
    }
    (text, markers)
}

pub mod redis;
