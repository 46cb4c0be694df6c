//! `equiroute mock-upstream`: a mock OpenAI-compatible and search API for tests and demos.

use anyhow::Context;
use equiroute_mock::MockProfile;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:9090")]
    listen: String,
    /// Profile (TOML): per-route latency (log-normal, Pareto tail or mixture), error rates and
    /// faults (`fault`, or `fault_mix` at random); default 20 ms, no errors.
    #[arg(long)]
    profile: Option<PathBuf>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let profile = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--profile {}: cannot read it", path.display()))?;
            MockProfile::from_toml(&text, &path.display().to_string())
                .map_err(anyhow::Error::msg)?
        }
        None => MockProfile::default(),
    };
    let addr: std::net::SocketAddr = args
        .listen
        .parse()
        .with_context(|| format!("--listen `{}`: write host:port", args.listen))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        println!(
            "mock upstream on http://{} (POST /v1/chat/completions, POST /search, GET /_stats)",
            listener.local_addr()?
        );
        equiroute_mock::serve(profile, listener, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
        anyhow::Ok(())
    })
}
