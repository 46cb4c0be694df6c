//! # equiroute-gateway
//!
//! The HTTP gateway: [`config`] (TOML → validated types), [`server`] (routes, middleware,
//! request execution on the core's state machine), [`upstream`] (one file per provider kind),
//! and [`mock`], a configurable mock upstream for tests, demos and benchmarks.

pub mod config;
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
    let state = server::state::AppState::new(config, 0x00e9_u64)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let app = server::router(Arc::new(state), config.max_body_bytes);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
