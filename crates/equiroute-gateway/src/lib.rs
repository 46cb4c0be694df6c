//! # equiroute-gateway
//!
//! The HTTP gateway: [`config`] (TOML → validated types), [`server`] (routes, middleware,
//! request execution on the core's state machine), [`upstream`] (one file per provider kind),
//! and [`mock`], a configurable mock upstream for tests, demos and benchmarks.

pub mod config;
pub mod feedback;
pub mod mock;
pub mod server;
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
    // Request ids and sampling seeds differ from one start to the next.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x00e9, |d| d.as_nanos() as u64);
    let mut state = server::state::AppState::new(config, seed)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let mut writer = None;
    if let Some(cfg) = &config.audit {
        let (log, task) = server::audit::AuditLog::start(cfg.clone())?;
        state.audit = Some(log);
        writer = Some(task);
    }
    let app = server::router(Arc::new(state), config.max_body_bytes);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    // The state (and the log's sender) is gone once the last connection closed: the writer
    // drains what is queued, flushes and ends.
    if let Some(task) = writer {
        let _ = task.await;
    }
    Ok(())
}
