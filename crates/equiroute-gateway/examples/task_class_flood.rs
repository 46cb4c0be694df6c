//! What a flood of invented task classes costs the gateway: a client sends `--requests`
//! requests (default 200,000), each with a task class of its own (`--classes distinct`, the
//! default), one shared class (`one`) or none (`none`), through a gateway with a state file.
//! Reports the process's RSS (peak while the flood runs, and settled: 3 s after it ends),
//! the latency slices the policy keeps, and the state file and its parts after the final
//! snapshot.
//!
//! ```text
//! cargo run --release -p equiroute-gateway --example task_class_flood [-- --requests 200000 --classes distinct]
//! ```
//!
//! Memory and file sizes do not depend on the build profile; a debug build is slower (about
//! 1,500 requests/s instead of several thousand).
//!
//! With `--direct`, the same classes go straight into the policy's risk model instead (no
//! gateway, no state file), once bounded by `max_slices` alone (as before the byte budget)
//! and once with the default `max_slice_bytes`: the slice table's bytes and its snapshot.
//!
//! Loopback only; the state file goes to a temporary directory removed at the end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use equiroute_gateway::config::load;
use equiroute_gateway::store::Store;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes in a MiB.
const MIB: f64 = 1_048_576.0;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

/// `VmRSS` and `VmHWM` of this process, in KiB.
fn memory_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn config(state: &std::path::Path) -> String {
    format!(
        r#"
[state]
path = "{}"
snapshot_interval_s = 2

[interfaces.chat]
kind = "chat"
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "a"
kind = "sim"
model = "m"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}

[[interfaces.chat.providers]]
id = "b"
kind = "sim"
model = "m"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}
"#,
        state.display()
    )
}

/// One keep-alive connection sending requests `from, from + step, …` below `to`.
async fn client(
    addr: std::net::SocketAddr,
    classes: Arc<str>,
    range: (u64, u64, u64),
    failed: Arc<AtomicU64>,
) {
    let (from, to, step) = range;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"hello"}]}"#;
    let mut buf = Vec::with_capacity(8192);
    let mut n = from;
    while n < to {
        let class = match &*classes {
            "distinct" => format!("x-equiroute-task-class: flood-{n}\r\n"),
            "one" => "x-equiroute-task-class: flood\r\n".to_owned(),
            _ => String::new(),
        };
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{class}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(req.as_bytes()).await.unwrap();
        // Read one response: headers, then `content-length` bytes of body.
        buf.clear();
        let (head_end, length) = loop {
            let mut chunk = [0u8; 4096];
            let got = conn.read(&mut chunk).await.unwrap();
            assert!(got > 0, "the gateway closed the connection");
            buf.extend_from_slice(&chunk[..got]);
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                if !head.starts_with("http/1.1 200") {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                break (end + 4, length);
            }
        };
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            let got = conn.read(&mut chunk).await.unwrap();
            assert!(got > 0, "the gateway closed the connection");
            buf.extend_from_slice(&chunk[..got]);
        }
        n += step;
    }
}

/// Bytes of `v` as compact JSON.
fn json_len(v: &serde_json::Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

/// `requests` new classes (two candidates taking turns) into a risk model with `cfg`.
fn direct(requests: u64, label: &str, cfg: equiroute_core::policies::RiskConfig) {
    use equiroute_core::policies::AttemptObservation;
    use equiroute_core::policies::RiskModel;
    use equiroute_core::{AttemptOutcome, SlicePath, Timestamp};
    let mut m = RiskModel::new(2, cfg);
    let started = Instant::now();
    let outcome = AttemptOutcome::ok(300.0);
    for n in 0..requests {
        let class = format!("flood-{n}");
        m.observe(&AttemptObservation {
            candidate: (n % 2) as usize,
            features: &[],
            slice: SlicePath::from_parts(Some(&class), Some("<5s"), false, Some(0), 4),
            deadline: None,
            outcome: &outcome,
            now: Timestamp(n as f64),
        });
    }
    let json = serde_json::to_vec(&m.export()).map_or(0, |b| b.len());
    println!(
        "{label}: {} slices kept, {} evicted, table {:.2} MiB, exported state {:.2} MiB, {:.0} ns per request",
        m.slice_count(),
        m.take_evictions(),
        m.slice_bytes() as f64 / MIB,
        json as f64 / MIB,
        started.elapsed().as_nanos() as f64 / requests as f64
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let requests: u64 = arg("--requests", "200000").parse().unwrap();
    if std::env::args().any(|a| a == "--direct") {
        use equiroute_core::policies::RiskConfig;
        let unbudgeted = RiskConfig {
            max_slice_bytes: usize::MAX,
            ..RiskConfig::default()
        };
        direct(requests, "max_slices = 4096 alone", unbudgeted);
        direct(requests, "max_slice_bytes = 2 MiB", RiskConfig::default());
        return;
    }
    let classes: Arc<str> = arg("--classes", "distinct").into();
    let connections: u64 = 8;
    let dir = std::env::temp_dir().join(format!("equiroute-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state_path = dir.join("state.redb");
    let cfg = load(&config(&state_path), "flood.toml", &|_| None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        equiroute_gateway::serve(&cfg, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    let (before, _) = memory_kib();
    // RSS sampled every 20 ms while the flood runs.
    let running = Arc::new(AtomicBool::new(true));
    let peak = Arc::new(AtomicU64::new(before));
    let sampler = {
        let (running, peak) = (running.clone(), peak.clone());
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                peak.fetch_max(memory_kib().0, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let started = Instant::now();
    let failed = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..connections {
        clients.push(tokio::spawn(client(
            addr,
            classes.clone(),
            (c, requests, connections),
            failed.clone(),
        )));
    }
    for c in clients {
        c.await.unwrap();
    }
    let elapsed = started.elapsed();
    // Settled: after a snapshot has run on the flood's state.
    tokio::time::sleep(Duration::from_secs(3)).await;
    running.store(false, Ordering::Relaxed);
    sampler.join().unwrap();
    let (settled, hwm) = memory_kib();
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let file_bytes = std::fs::metadata(&state_path).map_or(0, |m| m.len());
    let snapshot = Store::export_file(&state_path).unwrap();
    let policy = &snapshot["interfaces"]["chat"]["policy"];
    let slices = policy
        .pointer("/risk/slices")
        .or_else(|| policy.pointer("/state/risk/slices"))
        .or_else(|| find_slices(policy));
    let slice_count = slices.and_then(|s| s.as_array()).map_or(0, Vec::len);
    println!(
        "{requests} requests, task classes: {classes}, {:.1} s ({:.0} req/s), {} not 200",
        elapsed.as_secs_f64(),
        requests as f64 / elapsed.as_secs_f64(),
        failed.load(Ordering::Relaxed)
    );
    println!(
        "RSS: {:.1} MiB before, peak {:.1} MiB (sampled; VmHWM {:.1} MiB), settled {:.1} MiB",
        mib(before),
        mib(peak.load(Ordering::Relaxed)),
        mib(hwm),
        mib(settled)
    );
    println!(
        "state file: {:.2} MiB on disk; snapshot JSON {:.2} MiB: policy {:.2} MiB ({slice_count} latency slices, {:.2} MiB), pending feedback {:.2} MiB ({} contexts)",
        file_bytes as f64 / MIB,
        json_len(&snapshot) as f64 / MIB,
        json_len(policy) as f64 / MIB,
        slices.map_or(0, json_len) as f64 / MIB,
        json_len(&snapshot["pending"]) as f64 / MIB,
        snapshot["pending"].as_array().map_or(0, Vec::len),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first `slices` array anywhere under `v` (the policy's state nests it by kind).
fn find_slices(v: &serde_json::Value) -> Option<&serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => m
            .get("slices")
            .filter(|s| s.is_array())
            .or_else(|| m.values().find_map(find_slices)),
        serde_json::Value::Array(a) => a.iter().find_map(find_slices),
        _ => None,
    }
}
