//! # equiroute-gateway
//!
//! The HTTP gateway: [`config`] (TOML → validated types), [`server`] (routes, middleware,
//! request execution on the core's state machine) and [`upstream`] (one file per provider
//! kind). The mock upstream of its tests and benchmarks is a crate of its own, `equiroute-mock`.

pub mod config;
pub mod feedback;
pub mod pending;
pub mod redact;
pub mod request;
pub mod server;
pub mod shared;
pub mod store;
pub mod telemetry;
pub mod upstream;

use std::future::Future;
use std::sync::Arc;

/// Serves `config` on `listener` until `shutdown` resolves, then drains in-flight requests.
///
/// # Errors
/// The state cannot be built, or the server fails.
pub async fn serve(
    config: &config::GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_loops(config, listener, Vec::new(), shutdown).await
}

/// [`serve`] with more event loops: [`prepare`], then [`Prepared::serve`].
///
/// # Errors
/// The state cannot be built, a thread cannot start, or a server fails.
pub async fn serve_loops(
    config: &config::GatewayConfig,
    listener: tokio::net::TcpListener,
    more: Vec<std::net::TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    prepare(config).await?.serve(listener, more, shutdown).await
}

/// A gateway ready to serve: its state built and restored (from the state file, or from
/// what the other instances learnt through Redis), its audit log open. What can fail at
/// start fails here, before anything says the gateway is listening.
pub struct Prepared {
    state: Arc<server::state::AppState>,
    app: server::conn::App,
    limits: config::ConnectionLimits,
    /// How long the drain lasts before what is still in flight is ended through `cutoff`.
    grace: std::time::Duration,
    cutoff: server::drain::Cutoff,
    /// The state file and the interval between snapshots.
    store: Option<(Arc<store::Store>, std::time::Duration)>,
    syncer: Option<shared::Syncer>,
    audit_writer: Option<tokio::task::JoinHandle<()>>,
    /// HTTPS's certificate and key (`[server.tls]`); none: plain HTTP.
    tls: Option<Arc<server::conn::tls::TlsFiles>>,
}

/// Builds the state of a gateway for `config`.
///
/// # Errors
/// The state cannot be built, or the audit log, the state file or Redis cannot be opened.
pub async fn prepare(config: &config::GatewayConfig) -> std::io::Result<Prepared> {
    // Request ids and sampling seeds differ from one start to the next.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x00e9, |d| d.as_nanos() as u64);
    let mut state = server::state::AppState::new(config, seed)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let mut audit_writer = None;
    if let Some(cfg) = &config.audit {
        let (log, task) = server::audit::AuditLog::start(cfg.clone())?;
        state.audit = Some(log);
        audit_writer = Some(task);
    }
    let mut store = None;
    let mut syncer = None;
    match &config.state {
        Some(config::StateConfig::File(cfg)) => {
            // Restored before the file is opened for writing: a refused file stays untouched.
            let (s, restored) = store::Store::open_restoring(&cfg.path, &state)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            tracing::info!(
                path = %cfg.path.display(),
                restored = restored.is_some(),
                snapshot_age_s = restored.and_then(|r| r.snapshot_age).map(|d| d.as_secs()),
                "learning state file opened{}",
                if restored.is_some() { ": restored its last snapshot" } else { ": no snapshot yet, starting from empty statistics" }
            );
            store = Some((
                Arc::new(s),
                std::time::Duration::from_secs_f64(cfg.snapshot_interval_s.max(0.05)),
            ));
        }
        Some(config::StateConfig::Redis(cfg)) => {
            let mut s = shared::Syncer::start(cfg, &state)
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            // Start from what the other instances learnt (a no-op when Redis is down).
            s.tick(&state).await;
            tracing::info!(namespace = %cfg.namespace, "learning state shared through Redis");
            syncer = Some(s);
        }
        None => {}
    }
    tracing::info!(
        interfaces = config.interfaces.len(),
        providers = config
            .interfaces
            .iter()
            .map(|i| i.providers.len())
            .sum::<usize>(),
        "gateway ready"
    );
    let tls = config
        .tls
        .as_ref()
        .map(|t| server::conn::tls::TlsFiles::open(t, &state.metrics))
        .transpose()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let state = Arc::new(state);
    let cutoff = server::drain::Cutoff::new();
    let app = server::conn::App::new(
        server::router(state.clone(), config.max_body_bytes),
        config.max_body_bytes,
        &cutoff,
    );
    Ok(Prepared {
        state,
        app,
        limits: config.connections,
        grace: config.shutdown_grace,
        cutoff,
        store,
        syncer,
        audit_writer,
        tls,
    })
}

impl Prepared {
    /// Lets this gateway reload its configuration from `source` (`SIGHUP` through
    /// [`Prepared::reloader`], `POST /v1/admin/reload`); without one, a reload is refused.
    #[must_use]
    pub fn with_source(self, source: config::ConfigSource) -> Prepared {
        let _ = self.state.source.set(source);
        self
    }

    /// A handle that reloads the configuration of this gateway while it serves.
    #[must_use]
    pub fn reloader(&self) -> Reloader {
        Reloader {
            state: Arc::downgrade(&self.state),
        }
    }
}

/// Reloads a serving gateway's configuration ([`server::reload::reload`]): what the binary's
/// `SIGHUP` handler calls. It does not keep the gateway's state alive: once the gateway has
/// stopped, a reload is refused.
#[derive(Clone, Debug)]
pub struct Reloader {
    state: std::sync::Weak<server::state::AppState>,
}

impl Reloader {
    /// Reads the configuration again and applies it; logged and counted.
    ///
    /// # Errors
    /// Why it was refused; the running configuration keeps serving.
    pub async fn reload(&self) -> Result<server::reload::Reloaded, server::reload::ReloadError> {
        let state = self
            .state
            .upgrade()
            .ok_or(server::reload::ReloadError::Stopped)?;
        server::reload::reload(&state).await
    }
}

/// After the grace period, how long the error events that end the streams still open get to
/// reach their clients before the gateway stops waiting for their connections.
const CUTOFF_DELIVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Prepared {
    /// The HTTPS certificate and key, when `[server.tls]` is set: [`TlsFiles::reload`]
    /// re-reads them (the SIGHUP handler's job; they are also re-read when they change).
    ///
    /// [`TlsFiles::reload`]: server::conn::tls::TlsFiles::reload
    #[must_use]
    pub fn tls_files(&self) -> Option<Arc<server::conn::tls::TlsFiles>> {
        self.tls.clone()
    }

    /// Serves on `listener` and on each of `more` (listening sockets bound to the same
    /// address with `SO_REUSEPORT`, so the kernel spreads connections over them, each served
    /// by a single-threaded runtime on a thread of its own) until `shutdown` resolves, then
    /// drains in-flight requests and saves the state. One learning state, one set of upstream
    /// clients, one connection limit over every loop. Like nginx's workers, each connection
    /// stays on one thread: no work-stealing scheduler to wake between accepting, routing and
    /// the upstream call.
    ///
    /// # Errors
    /// A thread cannot start, a socket cannot be used, or the last snapshot cannot be saved.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        more: Vec<std::net::TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        self.serve_until(listener, more, shutdown, std::future::pending())
            .await
    }

    /// [`Prepared::serve`], with a bounded drain: `shutdown` (a first stop signal) stops
    /// accepting and lets requests in flight finish for `server.shutdown_grace_ms`; then, or
    /// as soon as `hurry` resolves (a second signal), the requests still in flight are ended
    /// (a stream with an error event), and the state is saved. The gateway does not wait for
    /// the connections of ended requests beyond a second (none after `hurry`): an event
    /// loop's thread still serving one is left to the process's exit.
    ///
    /// # Errors
    /// A thread cannot start, a socket cannot be used, or the last snapshot cannot be saved.
    pub async fn serve_until(
        self,
        listener: tokio::net::TcpListener,
        more: Vec<std::net::TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
        hurry: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Prepared {
            state,
            app,
            limits,
            grace,
            cutoff,
            store,
            syncer,
            audit_writer,
            tls,
        } = self;
        // Periodic snapshots, off the request path.
        let saver = store
            .as_ref()
            .map(|(s, every)| tokio::spawn(store::keep_saving(s.clone(), state.clone(), *every)));
        // The summaries of rate-limited log lines, written even when nothing follows a burst.
        let summaries = tokio::spawn(server::state::keep_summing_up(state.clone()));
        // Background exchange with the other instances; a last push after the drain.
        let (stop_sync, stop_rx) = tokio::sync::watch::channel(false);
        let sync_task = syncer.map(|s| tokio::spawn(s.run(state.clone(), stop_rx)));
        // Every loop drains when `shutdown` resolves.
        let slots = server::conn::ConnectionSlots::counted(&limits, &state.metrics);
        let (stop_loops, loops_rx) = tokio::sync::watch::channel(false);
        let acceptor = server::conn::tls::Tls::start(tls, &state, &loops_rx)?;
        let (loops, ended) = spawn_loops(&app, &slots, acceptor.as_ref(), more, &loops_rx)?;
        let drained = {
            let main = server::conn::serve(listener, app, slots, loops_rx, acceptor);
            // Every loop, this one and the threads', has closed its last connection.
            let main = async move {
                main.await;
                for thread in ended {
                    let _ = thread.await;
                }
            };
            tokio::pin!(main);
            tokio::pin!(hurry);
            tokio::select! {
                () = &mut main => true,
                () = shutdown => {
                    let _ = stop_loops.send(true);
                    tracing::info!(grace_ms = grace.as_millis(), "stopping: draining the requests in flight");
                    let hurried = tokio::select! {
                        () = &mut main => None,
                        () = tokio::time::sleep(grace) => Some(false),
                        () = &mut hurry => Some(true),
                    };
                    match hurried {
                        None => true,
                        Some(hurried) => {
                            tracing::warn!(
                                grace_ms = grace.as_millis(),
                                "{}: ending the requests still in flight (streams get an error event)",
                                if hurried { "second stop signal" } else { "grace period over" }
                            );
                            cutoff.cut();
                            !hurried
                                && tokio::time::timeout(CUTOFF_DELIVERY, &mut main).await.is_ok()
                        }
                    }
                }
            }
        };
        let _ = stop_loops.send(true);
        for thread in loops {
            // After a cut, a thread may still serve a connection that has not closed: not
            // waited for (it ends with the process).
            if !drained && !thread.is_finished() {
                continue;
            }
            let joined = tokio::task::spawn_blocking(move || thread.join())
                .await
                .map_err(std::io::Error::other)?;
            joined.map_err(|_| std::io::Error::other("an event loop thread panicked"))??;
        }
        if let Some(task) = saver {
            end(task).await;
        }
        end(summaries).await;
        state.logs.flush(true);
        let _ = stop_sync.send(true);
        if let Some(task) = sync_task {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
        }
        // The last snapshot, after every in-flight request has finished or been ended.
        if let Some((s, _)) = &store {
            let (s, st) = (s.clone(), state.clone());
            let saved = tokio::task::spawn_blocking(move || s.save_final(&st))
                .await
                .map_err(std::io::Error::other)?;
            state.metrics.snapshot(
                saved
                    .as_ref()
                    .map_or_else(|e| e.write_failure().label(), |()| "saved"),
            );
            saved.map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        // Dropping the state drops the audit log's sender: the writer drains, flushes and ends.
        drop(state);
        if let Some(task) = audit_writer {
            // Connections left open after a cut still hold the state, and the writer's sender.
            if drained {
                let _ = task.await;
            } else {
                let _ = tokio::time::timeout(CUTOFF_DELIVERY, task).await;
            }
        }
        Ok(())
    }
}

/// Ends a background task and waits for it to go.
async fn end(task: tokio::task::JoinHandle<()>) {
    task.abort();
    let _ = task.await;
}

/// A loop thread's handle.
type LoopThread = std::thread::JoinHandle<std::io::Result<()>>;

/// Starts a thread with a single-threaded runtime serving `app` (over `tls` when set) on each
/// socket, until `stop`
/// turns true. Returns the threads, and for each a receiver that resolves when it ends.
fn spawn_loops(
    app: &server::conn::App,
    slots: &Arc<server::conn::ConnectionSlots>,
    tls: Option<&Arc<server::conn::tls::Tls>>,
    sockets: Vec<std::net::TcpListener>,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<(Vec<LoopThread>, Vec<tokio::sync::oneshot::Receiver<()>>)> {
    let mut loops = Vec::with_capacity(sockets.len());
    let mut ended = Vec::with_capacity(sockets.len());
    for (n, socket) in sockets.into_iter().enumerate() {
        let (app, slots, stop, tls) = (app.clone(), slots.clone(), stop.clone(), tls.cloned());
        // Dropped when the thread ends, however it ends.
        let (end, ends) = tokio::sync::oneshot::channel::<()>();
        ended.push(ends);
        let thread = std::thread::Builder::new()
            .name(format!("equiroute-loop-{}", n + 1))
            .spawn(move || -> std::io::Result<()> {
                let _end = end;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    socket.set_nonblocking(true)?;
                    let listener = tokio::net::TcpListener::from_std(socket)?;
                    server::conn::serve(listener, app, slots, stop, tls).await;
                    Ok(())
                })
            })?;
        loops.push(thread);
    }
    Ok((loops, ended))
}
