//! TLS, with a certificate authority made by each test: the HTTPS listener (`[server.tls]`)
//! serving chat completions over HTTP/1.1 and HTTP/2 (chosen by ALPN), refusing what is not
//! a trusting TLS client, and serving a replaced certificate to new connections (a bad
//! replacement refused, the old pair kept); and the learning state shared through Redis over
//! TLS (`rediss://`) with an ACL user and password, against a `redis-server` of the test's own
//! (skipped with a message where it is missing or built without TLS).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod common;

use bytes::Bytes;
use common::redis::{RedisServer, RedisTls};
use equiroute_core::policies::Observation;
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, SlicePath, Timestamp};
use equiroute_gateway::config::{load, StateConfig};
use equiroute_gateway::server::state::AppState;
use equiroute_gateway::shared::Syncer;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A certificate authority of the test's own.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    der: CertificateDer<'static>,
}

/// A server certificate and its key, in PEM, and the certificate's DER (what a client sees).
struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: CertificateDer<'static>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A certificate for `localhost` and 127.0.0.1, named `name`, signed by this CA.
    fn issue(&self, name: &str) -> Leaf {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }
}

/// A fresh scratch directory.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("equiroute-tls-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `text` to `path` whole: a new file renamed over the old one, so that a reader
/// never sees half of it.
fn replace(path: &Path, text: &str) {
    let new = path.with_extension("new");
    std::fs::write(&new, text).unwrap();
    std::fs::rename(&new, path).unwrap();
}

/// Writes `leaf`'s key, then its certificate, into `dir`.
fn install(dir: &Path, leaf: &Leaf) {
    replace(&dir.join("key.pem"), &leaf.key_pem);
    replace(&dir.join("cert.pem"), &leaf.cert_pem);
}

/// A chat interface on an OpenAI-compatible mock at `mock`, served over HTTPS with the pair
/// in `dir`, with a short header timeout (it bounds the handshake) and idle timeout.
fn https_config(dir: &Path, mock: SocketAddr) -> String {
    format!(
        r#"
[server]
header_read_timeout_ms = 500
idle_timeout_ms = 1500

[server.tls]
cert_file = "{}"
key_file = "{}"

[interfaces.chat]
kind = "chat"
deadline_ms = 5000

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "m"
base_url = "http://{mock}/v1"
"#,
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    )
}

/// A client trusting `ca` (none: trusting nobody), offering `alpn`.
fn client(ca: Option<&CertificateDer<'static>>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = ca {
        roots.add(ca.clone()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// The certificate the gateway presents to a new connection.
async fn presented(addr: SocketAddr, ca: &Ca) -> CertificateDer<'static> {
    let stream = connect(addr, client(Some(&ca.der), &[b"http/1.1"]))
        .await
        .unwrap();
    stream.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// A chat completion, streamed or not.
fn chat_request(uri: &str, stream: bool) -> http::Request<Full<Bytes>> {
    let body = format!(
        r#"{{"model":"chat","stream":{stream},"messages":[{{"role":"user","content":"hello over tls"}}]}}"#
    );
    http::Request::post(uri)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// One request over HTTP/1.1 on `stream`: the status, the provider that answered and the
/// body.
async fn http1(stream: TlsStream<TcpStream>, req: http::Request<Full<Bytes>>) -> (u16, String) {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let response = sender.send_request(req).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_11);
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `GET path` over HTTPS (HTTP/1.1), trusting `ca`.
async fn get(addr: SocketAddr, ca: &Ca, path: &str) -> String {
    let stream = connect(addr, client(Some(&ca.der), &[b"http/1.1"]))
        .await
        .unwrap();
    let req = http::Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, body) = http1(stream, req).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Waits (at most 10 s) until `series` of the gateway's `/metrics` is at least `at_least`.
async fn wait_metric(addr: SocketAddr, ca: &Ca, series: &str, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = common::metric(&get(addr, ca, "/metrics").await, series);
        if got >= at_least {
            return;
        }
        assert!(Instant::now() < deadline, "{series} stayed at {got}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A gateway served from `prepare` (so that the test holds its certificate files).
struct Served {
    addr: SocketAddr,
    files: Arc<equiroute_gateway::server::conn::tls::TlsFiles>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve(config: &str) -> Served {
    let cfg = load(config, "tls.toml", &|_| None).unwrap();
    let prepared = equiroute_gateway::prepare(&cfg).await.unwrap();
    let files = prepared.tls_files().expect("[server.tls] is set");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        prepared
            .serve(listener, Vec::new(), async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Served {
        addr,
        files,
        _stop: stop,
    }
}

/// A gateway over HTTPS on a mock upstream, presenting `first`, a certificate of its own CA;
/// its scratch directory removed at the end.
struct Https {
    mock: common::Gateway,
    ca: Ca,
    dir: PathBuf,
    first: Leaf,
    gw: Served,
}

impl Drop for Https {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn https(name: &str) -> Https {
    let mock = common::mock("[chat]\nlatency = { p50_ms = 2, p95_ms = 4 }\n").await;
    let ca = Ca::new("equiroute test CA");
    let dir = scratch(name);
    let first = ca.issue("first");
    install(&dir, &first);
    let gw = serve(&https_config(&dir, mock.addr)).await;
    Https {
        mock,
        ca,
        dir,
        first,
        gw,
    }
}

#[tokio::test]
async fn chat_completions_over_https_with_http1_and_with_http2_chosen_by_alpn() {
    let Https { mock, ca, gw, .. } = &https("protocols").await;

    // HTTP/1.1: a client that offers only it.
    let stream = connect(gw.addr, client(Some(&ca.der), &[b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (status, body) = http1(stream, chat_request("/v1/chat/completions", false)).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );

    // HTTP/2: offered first, chosen; two requests at once on the one connection, one of
    // them streamed.
    let stream = connect(gw.addr, client(Some(&ca.der), &[b"h2", b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, conn) =
        // Pinging every 200 ms, idle or not: frames between requests.
        hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Duration::from_millis(200))
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(conn);
    let ask = |mut sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>, stream: bool| async move {
        let response = sender
            .send_request(chat_request(
                "https://localhost/v1/chat/completions",
                stream,
            ))
            .await
            .unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        let status = response.status().as_u16();
        let provider = response
            .headers()
            .get("x-equiroute-provider")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            provider,
            String::from_utf8_lossy(&body).into_owned(),
        )
    };
    let (whole, streamed) = tokio::join!(ask(sender.clone(), false), ask(sender.clone(), true));
    for (status, provider, body) in [&whole, &streamed] {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(provider.as_deref(), Some("a"));
    }
    let answer: Value = serde_json::from_str(&whole.2).unwrap();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let (text, _) = common::streamed_text(&streamed.2);
    let events = streamed
        .2
        .lines()
        .filter(|l| l.starts_with("data: "))
        .count();
    assert!(!text.is_empty() && events >= 3, "{}", streamed.2);
    assert!(
        streamed.2.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.2
    );
    // A body of 300 KB, over four times the stream's flow-control window: it all arrives.
    let big = serde_json::json!({
        "model": "chat",
        "messages": [{"role": "user", "content": "x".repeat(300_000)}],
    });
    let req = http::Request::post("https://localhost/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(big.to_string())))
        .unwrap();
    let response = sender.clone().send_request(req).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{"), "{body:?}");
    assert_eq!(
        common::calls(mock.addr, "m").await,
        4,
        "every request reached the mock"
    );
    // Idle, the connection is closed after idle_timeout_ms (1.5 s), not the header timeout
    // (0.5 s): the client's pings between requests start no request head.
    let idle = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(closed.is_ok(), "the idle HTTP/2 connection was not closed");
    assert!(
        idle.elapsed() >= Duration::from_millis(1200),
        "closed after {:?}",
        idle.elapsed()
    );
}

#[tokio::test]
async fn untrusting_plain_and_silent_clients_get_no_answer_and_are_counted() {
    let Https { ca, gw, .. } = &https("refusals").await;
    let failures =
        |reason: &str| format!("equiroute_tls_handshake_failures_total{{reason=\"{reason}\"}}");
    // The series exist from the start.
    let metrics = get(gw.addr, ca, "/metrics").await;
    for reason in ["timeout", "not_tls", "certificate_rejected", "other"] {
        assert!(
            metrics.contains(&format!("{} 0", failures(reason))),
            "{metrics}"
        );
    }

    // A client trusting another CA refuses the certificate.
    let other = Ca::new("another CA");
    let refused = connect(gw.addr, client(Some(&other.der), &[b"http/1.1"])).await;
    let Err(e) = refused else {
        panic!("a client not trusting the CA was served");
    };
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    wait_metric(gw.addr, ca, &failures("certificate_rejected"), 1).await;

    // Plain HTTP to the HTTPS port: no HTTP answer, the connection closed.
    let mut plain = TcpStream::connect(gw.addr).await.unwrap();
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the connection is closed");
    assert!(
        !got.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    wait_metric(gw.addr, ca, &failures("not_tls"), 1).await;

    // A client that connects and says nothing is closed after the header timeout (500 ms).
    let started = Instant::now();
    let mut silent = TcpStream::connect(gw.addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "closed without an answer: {read:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "{:?}",
        started.elapsed()
    );
    wait_metric(gw.addr, ca, &failures("timeout"), 1).await;
}

#[tokio::test]
async fn a_replaced_certificate_serves_new_connections_and_a_bad_one_is_refused() {
    let Https {
        ca, dir, first, gw, ..
    } = &https("reload").await;
    assert_eq!(presented(gw.addr, ca).await, first.der);
    let reloads = |outcome: &str| format!("equiroute_tls_reloads_total{{outcome=\"{outcome}\"}}");

    // Replaced on disk: seen by the file check, served to the next connections.
    let second = ca.issue("second");
    install(dir, &second);
    let deadline = Instant::now() + Duration::from_secs(10);
    while presented(gw.addr, ca).await != second.der {
        assert!(
            Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_metric(gw.addr, ca, &reloads("ok"), 1).await;

    // On demand (the SIGHUP path): served at once.
    let third = ca.issue("third");
    install(dir, &third);
    gw.files.reload().unwrap();
    assert_eq!(presented(gw.addr, ca).await, third.der);

    // A certificate whose key is not on disk: refused, and the old pair keeps serving.
    let stray = ca.issue("stray");
    replace(&dir.join("cert.pem"), &stray.cert_pem);
    let refused = gw.files.reload().unwrap_err();
    assert_eq!(refused.field, "key_file");
    assert!(refused.why.contains("is not the key of"), "{refused}");
    assert_eq!(presented(gw.addr, ca).await, third.der);
    // Not PEM at all: refused the same way.
    replace(&dir.join("cert.pem"), "not a certificate");
    let refused = gw.files.reload().unwrap_err();
    assert_eq!(refused.field, "cert_file");
    assert_eq!(presented(gw.addr, ca).await, third.der);
    wait_metric(gw.addr, ca, &reloads("refused"), 2).await;
    // And the gateway still answers over the old pair.
    let stream = connect(gw.addr, client(Some(&ca.der), &[b"http/1.1"]))
        .await
        .unwrap();
    let (status, body) = http1(stream, chat_request("/v1/chat/completions", false)).await;
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_bad_pair_is_refused_at_load_naming_the_field_and_the_fix() {
    let ca = Ca::new("equiroute test CA");
    let dir = scratch("load");
    let (one, two) = (ca.issue("one"), ca.issue("two"));
    std::fs::write(dir.join("cert.pem"), &one.cert_pem).unwrap();
    std::fs::write(dir.join("key.pem"), &two.key_pem).unwrap();
    let text = https_config(&dir, "127.0.0.1:9".parse().unwrap());
    let e = load(&text, "t.toml", &|_| None).unwrap_err();
    assert_eq!(e.field, "server.tls.key_file");
    assert!(
        e.fix.contains("is not the key of the certificate"),
        "{}",
        e.fix
    );
    std::fs::remove_file(dir.join("cert.pem")).unwrap();
    let e = load(&text, "t.toml", &|_| None).unwrap_err();
    assert_eq!(e.field, "server.tls.cert_file");
    assert!(e.fix.contains("does not exist"), "{}", e.fix);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `n` attempts on the three providers, with varied latencies and failures.
fn attempts(n: usize) -> Vec<Observation> {
    (0..n)
        .map(|k| {
            let features: Vec<f64> = (0..16)
                .map(|j| {
                    if j == 0 {
                        1.0
                    } else {
                        ((k * 7 + j * 3) % 11) as f64 / 11.0 - 0.5
                    }
                })
                .collect();
            let status = if k % 9 == 4 {
                AttemptStatus::ProviderError(equiroute_core::ProviderFailure::Server)
            } else {
                AttemptStatus::Ok
            };
            Observation::Attempt {
                candidate: k % 3,
                features,
                slice: SlicePath::root(),
                deadline: Some(Millis(300.0)),
                outcome: AttemptOutcome::with_status(40.0 + ((k * 37) % 200) as f64, status),
                now: Timestamp(1.7e12 + k as f64 * 10.0),
            }
        })
        .collect()
}

#[tokio::test]
async fn two_gateways_share_learning_through_redis_over_tls_with_a_user_and_password() {
    let ca = Ca::new("redis test CA");
    let dir = scratch("redis");
    let leaf = ca.issue("redis");
    std::fs::write(dir.join("redis.crt"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("redis.key"), &leaf.key_pem).unwrap();
    std::fs::write(dir.join("ca.crt"), &ca.pem).unwrap();
    let password = "tls-test-password-4f1c";
    let tls = RedisTls {
        cert_file: dir.join("redis.crt"),
        key_file: dir.join("redis.key"),
        ca_file: dir.join("ca.crt"),
        user: "equiroute".into(),
        password: password.into(),
    };
    let Some(redis) = RedisServer::start_tls("tls", tls) else {
        return;
    };
    let mut text = format!(
        "[state]\nbackend = \"redis\"\nurl = \"{}\"\nusername = \"equiroute\"\npassword_env = \"EQUIROUTE_REDIS_PASSWORD\"\ntls_ca_file = \"{}\"\nnamespace = \"tls\"\nsync_interval_ms = 50\n\n[interfaces.chat]\nkind = \"chat\"\nfeature_dim = 16\npolicy = {{ name = \"lqm-ts\", lqm = {{ head = {{ window = 25 }} }} }}\n",
        redis.url(),
        dir.join("ca.crt").display()
    );
    for p in ["a", "b", "c"] {
        let _ = writeln!(
            text,
            "[[interfaces.chat.providers]]\nid = \"{p}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}"
        );
    }
    let with = |secret: &'static str| {
        move |name: &str| (name == "EQUIROUTE_REDIS_PASSWORD").then(|| secret.to_owned())
    };
    let cfg = load(&text, "t.toml", &with(password)).unwrap();
    let Some(StateConfig::Redis(shared)) = cfg.state.clone() else {
        panic!("a redis state");
    };
    assert!(shared.url.0.starts_with("rediss://"));
    let (a, b) = (
        AppState::new(&cfg, 1).unwrap(),
        AppState::new(&cfg, 2).unwrap(),
    );
    let mut sa = Syncer::start(&shared, &a).await.unwrap();
    let mut sb = Syncer::start(&shared, &b).await.unwrap();
    let iface = a.interface("chat").unwrap();
    let n = 120;
    for o in attempts(n) {
        a.observe(&iface, o).unwrap();
    }
    let pushed = sa.sync_once(&a).await.unwrap();
    assert_eq!(pushed.pushed, n, "{pushed:?}");
    let pulled = sb.sync_once(&b).await.unwrap();
    assert_eq!(pulled.applied_observations, n, "{pulled:?}");
    let state = |s: &Syncer| serde_json::to_value(&s.confirmed_states()["chat"]).unwrap();
    assert_eq!(
        state(&sb),
        state(&sa),
        "b learnt what a saw, through Redis over TLS"
    );

    // A wrong password: the gateway does not start, and says why without the password.
    let wrong = load(&text, "t.toml", &with("not-the-password-9d2e")).unwrap();
    let e = equiroute_gateway::prepare(&wrong)
        .await
        .err()
        .expect("a wrong password stops the start")
        .to_string();
    assert!(e.contains("refused the credentials"), "{e}");
    assert!(e.contains("state.password_env"), "{e}");
    assert!(
        !e.contains("not-the-password-9d2e") && !e.contains(password),
        "{e}"
    );
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}
