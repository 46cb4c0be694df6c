//! `equiroute serve`: the gateway, with the embedded default configuration when no
//! `--config` is given (in-process simulated providers: no keys, no services), its learning
//! kept in a state file in the user's state directory unless `--in-memory`.

use anyhow::Context;
use equiroute_gateway::config::{
    default_state_file, ConfigSource, GatewayConfig, LogFormat, Overrides, StateConfig,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Configuration file (TOML); without it, the embedded default with simulated providers.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on, overriding `server.listen` (e.g. 127.0.0.1:0 for any free port).
    #[arg(long)]
    listen: Option<String>,
    /// Start from empty statistics: delete the `[state]` file first (the way out of an
    /// incompatible or corrupt state file). Refused while another process holds the file,
    /// and with Redis while another instance of the namespace is running.
    #[arg(long)]
    reset_state: bool,
    /// Keep learning in memory only, forgotten at exit: no state file (not even the default
    /// one used without --config) and no Redis, whatever the configuration says.
    #[arg(long)]
    in_memory: bool,
}

/// What the command line changes in the configuration (`--in-memory`, the default state file
/// without `--config`, `--listen`): applied at start and to every reloaded configuration.
fn overrides(args: &Args) -> anyhow::Result<Overrides> {
    let listen = args
        .listen
        .as_ref()
        .map(|listen| {
            listen.parse::<std::net::SocketAddr>().with_context(|| {
                format!("--listen `{listen}`: write host:port, e.g. 127.0.0.1:8080")
            })
        })
        .transpose()?;
    let (in_memory, defaulted) = (args.in_memory, args.config.is_none());
    Ok(Arc::new(move |config: &mut GatewayConfig| {
        if in_memory {
            config.state = None;
        } else if defaulted {
            config.state = default_state_file(&|name| std::env::var(name).ok());
        }
        if let Some(listen) = listen {
            config.listen = listen;
        }
    }))
}

/// Where learning lives for this run, and why: the start-up line says it.
fn choose_state(args: &Args, config: &GatewayConfig) -> String {
    if args.in_memory {
        return "learning: in memory only (--in-memory), forgotten at exit".to_owned();
    }
    match &config.state {
        Some(StateConfig::File(f)) => format!(
            "learning: persists in {} (saved every {} s and at exit; --in-memory to forget it at exit)",
            f.path.display(),
            f.snapshot_interval_s
        ),
        Some(StateConfig::Redis(r)) => format!(
            "learning: persists in Redis, shared by the instances of namespace `{}`",
            r.namespace
        ),
        None if args.config.is_none() => "learning: in memory only, forgotten at exit (neither XDG_STATE_HOME nor HOME is set: there is no state directory)".to_owned(),
        None => "learning: in memory only, forgotten at exit (add a [state] section to keep it)".to_owned(),
    }
}

/// Runs the gateway; `log_format` is `--log-format`, which wins over `[server] log_format`.
pub fn run(args: &Args, log_format: Option<LogFormat>) -> anyhow::Result<()> {
    // The same source, overrides included, is read again at each reload.
    let source = ConfigSource::new(args.config.clone(), overrides(args)?);
    let file = source.shown();
    let config = source.read().map_err(anyhow::Error::msg)?;
    // The runtime first: the trace export (if any) runs on it, and starts with the logs.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let telemetry = config
        .telemetry
        .as_ref()
        .map(|t| equiroute_gateway::telemetry::Telemetry::start(t, runtime.handle()))
        .transpose()
        .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
    crate::logs::init_with(log_format.unwrap_or(config.log_format), telemetry.as_ref());
    if let Some(t) = &config.telemetry {
        tracing::info!(
            endpoint = %t.traces_url,
            sampling_ratio = t.sampling_ratio,
            "exporting traces over OTLP/HTTP"
        );
    }
    for w in &config.warnings {
        tracing::warn!(config = %file, "{w}");
    }
    let learning = choose_state(args, &config);
    // The default state directory may not exist yet; a configured path's directory must.
    if let (None, Some(StateConfig::File(f))) = (&args.config, &config.state) {
        if let Some(dir) = f.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| {
                format!(
                    "cannot create the state directory {}: set XDG_STATE_HOME, or start with --in-memory",
                    dir.display()
                )
            })?;
        }
    }
    // One event loop per thread (`server.worker_threads`, default one per core): the caller's
    // thread runs the first, with the background tasks; each other has a thread of its own.
    let loops = config.worker_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let served = runtime.block_on(async move {
        if args.reset_state {
            reset_state(config.state.as_ref()).await?;
        }
        let (listener, more) = listen(config.listen, loops)
            .with_context(|| format!("cannot listen on {}: is the port free?", config.listen))?;
        let addr = listener.local_addr()?;
        // The state (and its file or Redis) first: the banner says the gateway is ready.
        let gateway = equiroute_gateway::prepare(&config)
            .await?
            .with_source(source);
        let chat = config
            .interfaces
            .iter()
            .find(|i| i.kind == equiroute_gateway::config::InterfaceKind::Chat)
            .map_or("chat", |i| i.name.as_str());
        // Before the banner: a signal sent as soon as it is read is a stop, not a kill.
        let (first, second) = stop_signals()?;
        reload_on_hangup(gateway.reloader(), gateway.tls_files())?;
        let scheme = if config.tls.is_some() { "https" } else { "http" };
        tracing::info!(%addr, event_loops = loops, config = %file, tls = config.tls.is_some(), "listening");
        println!("equiroute listening on {scheme}://{addr} ({} interfaces from {file})", config.interfaces.len());
        println!("{learning}");
        println!(
            "try: curl -s {scheme}://{addr}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"{chat}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'"
        );
        gateway.serve_until(listener, more, first, second).await?;
        tracing::info!("stopped");
        println!("equiroute stopped");
        anyhow::Ok(())
    });
    if let Some(t) = telemetry {
        t.shutdown();
    }
    served
}

/// `loops` listening sockets on `addr` (the first one's port when `addr` asks for any), with
/// `SO_REUSEPORT` when there are several, so that the kernel spreads connections over them:
/// the first for this runtime, the others for the other event loops. A plain bind comes
/// first, so that a port another process (another Equiroute included) listens on is an
/// error rather than shared. One socket where `SO_REUSEPORT` is missing.
fn listen(
    addr: std::net::SocketAddr,
    loops: usize,
) -> std::io::Result<(tokio::net::TcpListener, Vec<std::net::TcpListener>)> {
    let probe = std::net::TcpListener::bind(addr)?;
    if loops <= 1 || !cfg!(unix) {
        probe.set_nonblocking(true)?;
        return Ok((tokio::net::TcpListener::from_std(probe)?, Vec::new()));
    }
    let addr = probe.local_addr()?;
    drop(probe);
    let bind = || -> std::io::Result<tokio::net::TcpListener> {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        #[cfg(unix)]
        socket.set_reuseport(true)?;
        socket.bind(addr)?;
        socket.listen(1024)
    };
    let first = bind()?;
    let more = (1..loops)
        .map(|_| bind()?.into_std())
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok((first, more))
}

/// `--reset-state`: deletes the state file (unless a running gateway holds it), or the
/// shared state's keys in Redis (unless an instance of the namespace is running).
async fn reset_state(state: Option<&StateConfig>) -> anyhow::Result<()> {
    match state {
        Some(StateConfig::File(f)) => {
            if equiroute_gateway::store::Store::remove(&f.path).context("--reset-state")? {
                println!("--reset-state: deleted {}", f.path.display());
            }
        }
        Some(StateConfig::Redis(r)) => {
            equiroute_gateway::shared::reset(r)
                .await
                .context("--reset-state")?;
            println!(
                "--reset-state: deleted the shared state of namespace `{}` in Redis",
                r.namespace
            );
        }
        None => println!("--reset-state: no [state] section, nothing to delete"),
    }
    Ok(())
}

/// Reloads the configuration at each `SIGHUP` (the same file, the same environment and
/// command line): a bad file is refused and the running configuration kept; the reload logs
/// and counts itself; then the HTTPS certificate and key, when the listener has them.
fn reload_on_hangup(
    reloader: equiroute_gateway::Reloader,
    tls: Option<std::sync::Arc<equiroute_gateway::server::conn::tls::TlsFiles>>,
) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangup = signal(SignalKind::hangup())?;
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                let _ = reloader.reload().await;
                // The certificate and key are read again too (logged and counted by `reload`).
                if let Some(files) = &tls {
                    let _ = files.reload();
                }
            }
        });
    }
    #[cfg(not(unix))]
    drop((reloader, tls));
    Ok(())
}

/// The stop signals (SIGINT, SIGTERM), installed now: the first future resolves at the first
/// signal (the drain starts), the second at the next one (the drain is cut short: the
/// snapshot is saved and the gateway exits).
fn stop_signals() -> std::io::Result<(
    impl std::future::Future<Output = ()> + Send + 'static,
    impl std::future::Future<Output = ()> + Send + 'static,
)> {
    let (count, seen) = tokio::sync::watch::channel(0u32);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(()) = int.recv() => {},
                    Some(()) = term.recv() => {},
                    else => break,
                }
                count.send_modify(|n| *n += 1);
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            count.send_modify(|n| *n += 1);
        }
    });
    let after = |n: u32| {
        let mut seen = seen.clone();
        async move {
            let _ = seen.wait_for(|count| *count >= n).await;
        }
    };
    Ok((after(1), after(2)))
}
