//! HTTPS: the TLS handshake of each accepted connection ([`Tls`]) and the certificate it
//! presents ([`TlsFiles`]), re-read from `server.tls.cert_file` and `key_file` when they
//! change or when [`TlsFiles::reload`] is called (the gateway's SIGHUP).
//!
//! A handshake must finish within `server.header_read_timeout_ms` (a silent or slow client
//! does not hold its connection slot longer than one that sends no request head); ALPN offers
//! `h2` and `http/1.1`, and the connection is then served as the client chose. A failed
//! handshake is counted (`equiroute_tls_handshake_failures_total{reason}`) and logged
//! rate-limited; the connection is closed.
//!
//! A reload reads and checks the new pair whole before swapping it in: a pair that does not
//! serve (a file half written, a key of another certificate) is refused with a `warn` line
//! naming the file, and the previous pair keeps serving (`equiroute_tls_reloads_total{outcome}`).
//! Each handshake reads the current pair under a read lock held for a pointer copy.

use super::super::metrics::{Metrics, TLS_HANDSHAKE_FAILURES};
use super::super::repeated::Repeated;
use super::super::state::AppState;
use crate::config::tls::{read_pair, PairProblem};
use crate::config::TlsConfig;
use prometheus_client::metrics::counter::Counter;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::server::TlsStream;

/// How often the certificate and key files are checked for a change (two `stat` calls).
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// What a file looked like when last read: its modification time and length.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &std::path::Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// The HTTPS certificate and key: the pair in use, and its files to re-read.
#[derive(Debug)]
pub struct TlsFiles {
    config: TlsConfig,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' stamps when last read (whether their pair was taken or refused), so that
    /// a refused pair is read again only once the files change again.
    seen: Mutex<(Stamp, Stamp)>,
    reloaded: Counter,
    refused: Counter,
}

impl TlsFiles {
    /// The pair of `config`, read now; reloads counted in `metrics`.
    ///
    /// # Errors
    /// The pair cannot serve (the file and why).
    pub fn open(config: &TlsConfig, metrics: &Metrics) -> Result<Arc<TlsFiles>, PairProblem> {
        let seen = (stamp(&config.cert_file), stamp(&config.key_file));
        let pair = read_pair(config)?;
        Ok(Arc::new(TlsFiles {
            config: config.clone(),
            current: RwLock::new(Arc::new(pair)),
            seen: Mutex::new(seen),
            reloaded: metrics.tls_reloads(true),
            refused: metrics.tls_reloads(false),
        }))
    }

    /// Reads the pair again and serves it to new connections, or refuses it (a `warn` line
    /// naming the file and why) and keeps the one in use. Connections already open keep
    /// the pair they were opened with.
    ///
    /// # Errors
    /// The refused pair's problem.
    pub fn reload(&self) -> Result<(), PairProblem> {
        let stamps = (stamp(&self.config.cert_file), stamp(&self.config.key_file));
        let read = read_pair(&self.config);
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = stamps;
        match read {
            Ok(pair) => {
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
                self.reloaded.inc();
                tracing::info!(
                    cert_file = %self.config.cert_file.display(),
                    "TLS certificate reloaded: new connections get the new pair"
                );
                Ok(())
            }
            Err(problem) => {
                self.refused.inc();
                tracing::warn!(
                    field = %format!("server.tls.{}", problem.field),
                    "TLS certificate reload refused, the previous pair keeps serving: {}",
                    problem.why
                );
                Err(problem)
            }
        }
    }

    /// Reloads if either file changed (its modification time or length) since it was last
    /// read; whether it did.
    pub fn reload_if_changed(&self) -> bool {
        let now = (stamp(&self.config.cert_file), stamp(&self.config.key_file));
        let changed = *self.seen.lock().unwrap_or_else(PoisonError::into_inner) != now;
        if changed {
            let _ = self.reload();
        }
        changed
    }

    /// Checks the files every [`RELOAD_CHECK_INTERVAL`] until `stop` turns true.
    pub async fn watch(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = stop.wait_for(|stop| *stop) => return,
                () = tokio::time::sleep(RELOAD_CHECK_INTERVAL) => {}
            }
            // Two `stat`s, and on a change a read of two small files: off the loop's thread.
            let files = self.clone();
            let _ = tokio::task::spawn_blocking(move || files.reload_if_changed()).await;
        }
    }
}

impl ResolvesServerCert for TlsFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }
}

/// The TLS side of an HTTPS listener: the acceptor (over [`TlsFiles`]), and the counters
/// and log of failed handshakes.
pub struct Tls {
    acceptor: tokio_rustls::TlsAcceptor,
    /// By reason, in the order of [`TLS_HANDSHAKE_FAILURES`].
    failures: [Counter; TLS_HANDSHAKE_FAILURES.len()],
    state: Arc<AppState>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

/// The ALPN protocols offered, preferred first.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

impl Tls {
    /// [`Tls::new`] for `files` when there are some (an HTTPS listener), with the files
    /// watched for a change until `stop` turns true; `None` for plain HTTP.
    ///
    /// # Errors
    /// rustls refuses the configuration (it does not with its own defaults).
    pub fn start(
        files: Option<Arc<TlsFiles>>,
        state: &Arc<AppState>,
        stop: &watch::Receiver<bool>,
    ) -> std::io::Result<Option<Arc<Tls>>> {
        let Some(files) = files else {
            return Ok(None);
        };
        let tls = Tls::new(files.clone(), state.clone())?;
        tokio::spawn(files.watch(stop.clone()));
        Ok(Some(tls))
    }

    /// An acceptor presenting `files`' current pair, offering HTTP/2 and HTTP/1.1.
    ///
    /// # Errors
    /// rustls refuses the configuration (it does not with its own defaults).
    pub fn new(files: Arc<TlsFiles>, state: Arc<AppState>) -> std::io::Result<Arc<Tls>> {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_cert_resolver(files);
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(Tls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            failures: TLS_HANDSHAKE_FAILURES
                .map(|reason| state.metrics.tls_handshake_failures(reason)),
            state,
        }))
    }

    /// The handshake of `stream` (from `peer`), within `limit`; `None` when it failed
    /// (counted, and logged rate-limited).
    pub(super) async fn handshake(
        &self,
        stream: TcpStream,
        peer: IpAddr,
        limit: Duration,
    ) -> Option<TlsStream<TcpStream>> {
        let (reason, detail) = match tokio::time::timeout(limit, self.acceptor.accept(stream)).await
        {
            Ok(Ok(stream)) => return Some(stream),
            Ok(Err(e)) => (failure_reason(&e), e.to_string()),
            Err(_) => (
                "timeout",
                format!(
                    "no handshake within {} ms (server.header_read_timeout_ms)",
                    limit.as_millis()
                ),
            ),
        };
        if let Some(i) = TLS_HANDSHAKE_FAILURES.iter().position(|r| *r == reason) {
            self.failures[i].inc();
        }
        if self.state.logs.allow(Repeated::TlsHandshakeFailed) {
            tracing::warn!(%peer, reason, "TLS handshake failed: {detail}");
        }
        None
    }
}

/// The reason label of a failed handshake's error.
fn failure_reason(e: &std::io::Error) -> &'static str {
    let Some(tls) = e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) else {
        return "other";
    };
    match tls {
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => "not_tls",
        rustls::Error::AlertReceived(alert) => {
            use rustls::AlertDescription as A;
            match alert {
                A::UnknownCA
                | A::BadCertificate
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::CertificateRevoked
                | A::UnsupportedCertificate
                | A::AccessDenied => "certificate_rejected",
                _ => "other",
            }
        }
        _ => "other",
    }
}
