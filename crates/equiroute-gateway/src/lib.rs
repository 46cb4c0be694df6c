//! # equiroute-gateway
//!
//! The HTTP gateway: [`config`] (TOML → validated types), [`server`] (routes, middleware,
//! request execution on the core's state machine), [`upstream`] (one file per provider kind),
//! and [`mock`], a configurable mock upstream for tests, demos and benchmarks.

pub mod config;
pub mod feedback;
pub mod mock;
pub mod pending;
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
    app: axum::Router,
    limits: config::ConnectionLimits,
    /// The state file and the interval between snapshots.
    store: Option<(Arc<store::Store>, std::time::Duration)>,
    syncer: Option<shared::Syncer>,
    audit_writer: Option<tokio::task::JoinHandle<()>>,
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
            let s =
                store::Store::open(&cfg.path).map_err(|e| std::io::Error::other(e.to_string()))?;
            let restored = s
                .restore(&state)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            // The file's last write is the last snapshot's (redb writes nothing else).
            let age_s = std::fs::metadata(&cfg.path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .filter(|_| restored)
                .map(|d| d.as_secs());
            tracing::info!(
                path = %cfg.path.display(),
                restored,
                snapshot_age_s = age_s,
                "learning state file opened{}",
                if restored { ": restored its last snapshot" } else { ": no snapshot yet, starting from empty statistics" }
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
    let state = Arc::new(state);
    let app = server::router(state.clone(), config.max_body_bytes);
    Ok(Prepared {
        state,
        app,
        limits: config.connections,
        store,
        syncer,
        audit_writer,
    })
}

impl Prepared {
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
        let Prepared {
            state,
            app,
            limits,
            store,
            syncer,
            audit_writer,
        } = self;
        // Periodic snapshots, off the request path (a blocking thread per save).
        let saver = store.as_ref().map(|(s, every)| {
            let (s, st, every) = (s.clone(), state.clone(), *every);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let (s, st) = (s.clone(), st.clone());
                    let saved = tracing::Instrument::instrument(
                        tokio::task::spawn_blocking(move || s.save(&st)),
                        tracing::debug_span!("snapshot"),
                    );
                    if let Ok(Err(e)) = saved.await {
                        tracing::warn!(error = %e, "periodic snapshot of the learning state failed; the previous one stays");
                    }
                }
            })
        });
        // The summaries of rate-limited log lines, written even when nothing follows a burst.
        let summaries = {
            let st = state.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(server::repeated::INTERVAL).await;
                    st.logs.flush(false);
                }
            })
        };
        // Background exchange with the other instances; a last push after the drain.
        let (stop_sync, stop_rx) = tokio::sync::watch::channel(false);
        let sync_task = syncer.map(|s| tokio::spawn(s.run(state.clone(), stop_rx)));
        // Every loop drains when `shutdown` resolves.
        let slots = server::conn::ConnectionSlots::new(limits.max_connections);
        let (stop_loops, loops_rx) = tokio::sync::watch::channel(false);
        let loops = spawn_loops(&app, limits, &slots, more, &loops_rx)?;
        {
            let main = server::conn::serve(listener, app, limits, slots, loops_rx);
            tokio::pin!(main);
            tokio::select! {
                () = &mut main => {}
                () = shutdown => {
                    let _ = stop_loops.send(true);
                    main.await;
                }
            }
        }
        let _ = stop_loops.send(true);
        for thread in loops {
            let joined = tokio::task::spawn_blocking(move || thread.join())
                .await
                .map_err(std::io::Error::other)?;
            joined.map_err(|_| std::io::Error::other("an event loop thread panicked"))??;
        }
        if let Some(task) = saver {
            task.abort();
            let _ = task.await;
        }
        summaries.abort();
        let _ = summaries.await;
        state.logs.flush(true);
        let _ = stop_sync.send(true);
        if let Some(task) = sync_task {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
        }
        // The last snapshot, after every in-flight request has finished.
        if let Some((s, _)) = &store {
            s.save(&state)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        // Dropping the state drops the audit log's sender: the writer drains, flushes and ends.
        drop(state);
        if let Some(task) = audit_writer {
            let _ = task.await;
        }
        Ok(())
    }
}

/// Starts a thread with a single-threaded runtime serving `app` on each socket, until `stop`
/// turns true.
fn spawn_loops(
    app: &axum::Router,
    limits: config::ConnectionLimits,
    slots: &Arc<server::conn::ConnectionSlots>,
    sockets: Vec<std::net::TcpListener>,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<Vec<std::thread::JoinHandle<std::io::Result<()>>>> {
    let mut loops = Vec::with_capacity(sockets.len());
    for (n, socket) in sockets.into_iter().enumerate() {
        let (app, slots, stop) = (app.clone(), slots.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(format!("equiroute-loop-{}", n + 1))
            .spawn(move || -> std::io::Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    socket.set_nonblocking(true)?;
                    let listener = tokio::net::TcpListener::from_std(socket)?;
                    server::conn::serve(listener, app, limits, slots, stop).await;
                    Ok(())
                })
            })?;
        loops.push(thread);
    }
    Ok(loops)
}
