//! Cost of sharing learning state through Redis: the time one sync takes with 3 instances,
//! 20 candidates and d = 64, and the request path's learning step with and without the
//! shared journal.
//!
//! ```text
//! cargo run --release -p equiroute-gateway --example sync_bench [-- --intervals 20 --rps 2000]
//! ```
//!
//! Starts its own `redis-server` on a free loopback port (stopped by PID at the end).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use equiroute_core::{AttemptOutcome, SlicePath};
use equiroute_gateway::config::{load, StateConfig};
use equiroute_gateway::server::state::AppState;
use equiroute_gateway::shared::Syncer;
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn config(redis: Option<&str>) -> String {
    let mut s = String::new();
    if let Some(url) = redis {
        let _ = writeln!(
            s,
            "[state]\nbackend = \"redis\"\nurl = \"{url}\"\nnamespace = \"bench\"\ncompact_every = 100000"
        );
    }
    s.push_str(
        "[interfaces.chat]\nkind = \"chat\"\nfeature_dim = 64\npolicy = { name = \"lqm-ts\" }\n",
    );
    for i in 0..20 {
        let _ = writeln!(
            s,
            "[[interfaces.chat.providers]]\nid = \"p{i}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}"
        );
    }
    s
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One request's learning step: rank, record the attempt, and (every other request) a
/// quality score, as the request and feedback paths do.
fn request(app: &AppState, k: usize) -> Duration {
    let iface = &app.interface("chat").unwrap();
    let features = iface
        .featurizer
        .featurize(&format!("question number {k} about topic {}", k % 37));
    let started = Instant::now();
    let all: Vec<usize> = (0..iface.candidates.len()).collect();
    let first = {
        let policy = iface.policy.read().unwrap();
        let ctx = equiroute_core::policies::RankContext::new(&iface.candidates, &all, &features);
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(k as u64);
        policy.rank(&ctx, &mut rng).order[0].index
    };
    let outcome = AttemptOutcome::ok(20.0 + (k % 50) as f64);
    app.record_attempt(iface, first, &features, SlicePath::root(), &outcome, None)
        .unwrap();
    if k.is_multiple_of(2) {
        let obs = equiroute_core::policies::QualityObservation {
            candidate: first,
            features: &features,
            quality: (k % 10) as f64 / 10.0,
            latency: outcome.latency,
            now: app.now(),
        };
        app.record_quality(iface, &format!("r{k}"), &obs).unwrap();
    }
    started.elapsed()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let intervals = arg("--intervals", 20);
    let rps = arg("--rps", 2000);
    let interval_ms = 500;
    let Some(binary) = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("redis-server"))
            .find(|p| p.is_file())
    }) else {
        eprintln!("sync_bench: redis-server not found on PATH (apt-get install redis-server)");
        std::process::exit(2);
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut redis = Command::new(binary)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let url = format!("redis://127.0.0.1:{port}");
    let text = config(Some(&url));
    let cfg = load(&text, "bench.toml", &|_| None).unwrap();
    let Some(StateConfig::Redis(rcfg)) = cfg.state.clone() else {
        unreachable!()
    };
    let apps: Vec<AppState> = (0..3).map(|i| AppState::new(&cfg, i).unwrap()).collect();
    let mut syncers = Vec::new();
    for a in &apps {
        syncers.push(Syncer::start(&rcfg, a).await.unwrap());
    }
    // Requests per instance per interval at `rps` in total.
    let per_instance = rps * interval_ms / 1000 / 3;
    println!(
        "sync_bench: 3 instances, 20 candidates, d=64, lqm-ts; {rps} requests/s in total = {per_instance} requests (+{} quality scores) per instance per {interval_ms} ms interval; {intervals} intervals",
        per_instance / 2
    );
    // The same requests on a gateway without shared state, interleaved with the shared ones
    // so that both see the same machine state.
    let local = AppState::new(&load(&config(None), "bench.toml", &|_| None).unwrap(), 7).unwrap();
    let mut local_path = Vec::new();
    let mut sync_ms = Vec::new();
    let mut shared_path = Vec::new();
    let mut k = 0;
    for round in 0..intervals {
        for a in &apps {
            for _ in 0..per_instance {
                shared_path.push(request(a, k).as_secs_f64() * 1e6);
                local_path.push(request(&local, k).as_secs_f64() * 1e6);
                k += 1;
            }
        }
        for (s, a) in syncers.iter_mut().zip(&apps) {
            let t = Instant::now();
            s.sync_once(a).await.unwrap();
            if round > 0 {
                sync_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        if round % 5 == 4 {
            println!("  interval {}/{intervals}", round + 1);
        }
    }
    let _ = redis.kill();
    let _ = redis.wait();
    println!();
    println!("| measure | p50 | p95 | p99 | n |");
    println!("|---|---|---|---|---|");
    let n = sync_ms.len();
    println!(
        "| sync per instance per interval (ms) | {:.2} | {:.2} | {:.2} | {n} |",
        percentile(&mut sync_ms, 0.5),
        percentile(&mut sync_ms, 0.95),
        percentile(&mut sync_ms, 0.99)
    );
    for (name, v) in [
        ("request path, local state (µs)", &mut local_path),
        ("request path, Redis backend (µs)", &mut shared_path),
    ] {
        let n = v.len();
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {n} |",
            percentile(v, 0.5),
            percentile(v, 0.95),
            percentile(v, 0.99)
        );
    }
}
