//! Learning state on disk, through the binary: `kill -9` during load never leaves a file the
//! next start refuses, and `state export|import` round-trips the snapshot.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_equiroute")
}

/// Starts `serve` and returns it with its address (read from its first line).
fn serve(config: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(bin())
        .args([
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let Some(start) = line.find("http://") else {
        let mut err = String::new();
        let _ = child.stderr.as_mut().unwrap().read_to_string(&mut err);
        panic!("serve did not start: {line} {err}");
    };
    let addr = line[start + 7..]
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    (child, addr)
}

/// An empty directory of this test run's own.
fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn post(addr: &str, path: &str, body: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn kill_9_during_load_then_restart_and_export_import() {
    let dir = fresh_dir("kill9");
    let config = dir.join("gw.toml");
    std::fs::write(
        &config,
        format!(
            "[state]\npath = {:?}\nsnapshot_interval_s = 0.05\n[interfaces.search]\nkind = \"tool\"\npolicy = {{ name = \"lqm\" }}\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n",
            dir.join("state.redb").display().to_string()
        ),
    )
    .unwrap();
    for round in 0..4 {
        let (mut child, addr) = serve(&config);
        for _ in 0..25 {
            let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
            assert!(reply.starts_with("HTTP/1.1 200"), "round {round}: {reply}");
            let id = reply
                .lines()
                .find_map(|l| l.strip_prefix("x-equiroute-request-id: "))
                .unwrap()
                .trim()
                .to_owned();
            post(
                &addr,
                "/v1/feedback",
                &format!(r#"{{"request_id":"{id}","quality":1.0}}"#),
            );
        }
        child.kill().unwrap(); // SIGKILL: no shutdown, no final snapshot
        child.wait().unwrap();
    }
    let out = Command::new(bin())
        .args(["state", "export", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snap["schema"], 1);
    let heads = &snap["interfaces"]["search"]["policy"]["heads"]["heads"];
    assert!(heads.is_array(), "{snap}");
    let exported = dir.join("snapshot.json");
    std::fs::write(&exported, &out.stdout).unwrap();
    let ok = Command::new(bin())
        .args([
            "state",
            "import",
            "--config",
            config.to_str().unwrap(),
            exported.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    std::fs::write(&exported, br#"{"schema": 99}"#).unwrap();
    let bad = Command::new(bin())
        .args([
            "state",
            "import",
            "--config",
            config.to_str().unwrap(),
            exported.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not an Equiroute state snapshot"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `server.worker_threads = 3`: three event loops, one listening socket each (`SO_REUSEPORT`).
/// Requests on fresh connections are all answered, a second instance cannot share the port,
/// and SIGTERM drains every loop.
#[test]
fn several_event_loops_answer_refuse_a_shared_port_and_stop_together() {
    let dir = fresh_dir("loops");
    let config = dir.join("gw.toml");
    let default = equiroute_gateway::config::DEFAULT_CONFIG;
    std::fs::write(
        &config,
        default.replacen("[server]", "[server]\nworker_threads = 3", 1),
    )
    .unwrap();
    assert!(
        std::fs::read_to_string(&config)
            .unwrap()
            .contains("worker_threads = 3"),
        "the embedded default has a [server] table"
    );
    let (mut child, addr) = serve(&config);
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"hello"}]}"#;
    for _ in 0..30 {
        let out = post(&addr, "/v1/chat/completions", body);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
    // Counted once requests were answered: the loops start after the address is printed.
    let threads = std::fs::read_dir(format!("/proc/{}/task", child.id()))
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.starts_with("equiroute-loop"))
                })
                .count()
        })
        .ok();
    if let Some(n) = threads {
        assert_eq!(n, 2, "two loop threads beside the main one");
    }
    let second = Command::new(bin())
        .args([
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            &addr,
        ])
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("is the port free"), "{err}");
    let termed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    if !termed {
        let _ = child.kill();
        let _ = child.wait();
        panic!("could not send SIGTERM (is `kill` on PATH?)");
    }
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("the loops did not drain within 20 s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let mut out = String::new();
    let _ = child.stdout.as_mut().unwrap().read_to_string(&mut out);
    assert!(out.contains("equiroute stopped"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve` says it is listening only once it is ready: a state file it cannot open is an
/// error on its own, with no "listening on" line before it.
#[test]
fn serve_prints_its_banner_only_once_the_state_file_is_open() {
    let dir = fresh_dir("banner");
    let state = dir.join("state.redb");
    std::fs::write(&state, b"not a redb file, and not an empty one either").unwrap();
    let config = dir.join("gw.toml");
    std::fs::write(
        &config,
        format!(
            "[state]\npath = {:?}\n[interfaces.search]\nkind = \"tool\"\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n",
            state.display().to_string()
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args([
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout} {stderr}");
    assert!(stderr.starts_with("Error: "), "{stderr}");
    assert!(
        !stdout.contains("listening on"),
        "the banner came before the failure: {stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
