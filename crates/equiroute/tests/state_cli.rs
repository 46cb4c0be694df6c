//! Learning state on disk, through the binary: `kill -9` during load never leaves a file the
//! next start refuses, and `state export|import` round-trips the snapshot; a file a running
//! gateway holds is reported as held (never as damaged, never reset); a damaged file is refused
//! untouched, without a panic; `state export` with nothing saved creates nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Output, Stdio};

mod common;
use common::{post, terminate};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_equiroute")
}

/// Starts `serve` and returns it with its address (read from the line that gives it).
fn serve(config: &std::path::Path) -> (Child, String) {
    serve_with(config, &[])
}

/// `serve` with more arguments (`--reset-state`).
fn serve_with(config: &std::path::Path, extra: &[&str]) -> (Child, String) {
    let mut cmd = Command::new(bin());
    cmd.args([
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ])
    .args(extra);
    let (child, lines) = start(&mut cmd, |line| line.contains("http://"));
    (child, address(&lines))
}

/// Spawns `cmd` (a `serve`) and reads its output up to the first line `last` accepts; the
/// lines read, that one included.
fn start(cmd: &mut Command, last: impl Fn(&str) -> bool) -> (Child, Vec<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let mut err = String::new();
            let _ = child.stderr.as_mut().unwrap().read_to_string(&mut err);
            panic!("serve did not start: {lines:?} {err}");
        }
        let done = last(&line);
        lines.push(line.trim_end().to_owned());
        if done {
            break;
        }
    }
    child.stdout = Some(stdout.into_inner());
    (child, lines)
}

/// The address in the line that says where the gateway listens.
fn address(lines: &[String]) -> String {
    let line = lines
        .iter()
        .find_map(|l| l.split_once("http://"))
        .unwrap()
        .1;
    line.split_whitespace().next().unwrap().to_owned()
}

/// Runs the binary to completion, without `RUST_BACKTRACE` (whatever the test runner has).
fn equiroute(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

/// A configuration in `dir` with one `sim` tool interface and its state in `dir/state.redb`.
fn state_config(dir: &std::path::Path, snapshot_interval_s: f64) -> std::path::PathBuf {
    let config = dir.join("gw.toml");
    std::fs::write(
        &config,
        format!(
            "[state]\npath = {:?}\nsnapshot_interval_s = {snapshot_interval_s:?}\n[interfaces.search]\nkind = \"tool\"\npolicy = {{ name = \"lqm\" }}\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n",
            dir.join("state.redb").display().to_string()
        ),
    )
    .unwrap();
    config
}

/// An empty directory of this test run's own.
fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn kill_9_during_load_then_restart_and_export_import() {
    let dir = fresh_dir("kill9");
    let config = state_config(&dir, 0.05);
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
    let status = terminate(&mut child);
    assert!(status.success(), "{status:?}");
    let mut out = String::new();
    let _ = child.stdout.as_mut().unwrap().read_to_string(&mut out);
    assert!(out.contains("equiroute stopped"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A gateway holds its state file while it runs. A second gateway, `state export`,
/// `state import` and `serve --reset-state` are told that another process (with its pid)
/// holds it, are never advised to reset it, and leave it in place; once the gateway has
/// stopped, the file exports.
#[test]
fn a_state_file_a_gateway_holds_is_reported_held_and_never_reset() {
    let dir = fresh_dir("held");
    let config = state_config(&dir, 3600.0);
    let state = dir.join("state.redb");
    let cfg = config.to_str().unwrap();
    let (mut child, addr) = serve(&config);
    let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let snapshot = dir.join("snapshot.json");
    std::fs::write(&snapshot, "{}").unwrap();
    let attempts = [
        vec!["state", "export", "--config", cfg],
        vec![
            "state",
            "import",
            "--config",
            cfg,
            snapshot.to_str().unwrap(),
        ],
        vec![
            "serve",
            "--config",
            cfg,
            "--listen",
            "127.0.0.1:0",
            "--reset-state",
        ],
        vec!["serve", "--config", cfg, "--listen", "127.0.0.1:0"],
    ];
    for args in &attempts {
        let out = equiroute(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("is in use by another process") && err.contains("do not delete it"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("serve --reset-state"), "{args:?}: {err}");
        // redb's whole-file flock carries its owner's pid in /proc/locks (Linux).
        if std::fs::read_to_string("/proc/locks").is_ok_and(|l| l.contains("FLOCK")) {
            assert!(
                err.contains(&format!("pid {}", child.id())),
                "{args:?}: {err}"
            );
        }
        assert!(state.exists(), "{args:?} left the held file in place");
    }
    // The gateway was not disturbed: it still answers, and stops cleanly.
    let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(terminate(&mut child).success());
    let out = equiroute(&["state", "export", "--config", cfg]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snap["schema"], 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A state file whose header is intact and whose pages are noise (redb panicked on it
/// before: exit 101, "entered unreachable code"). `serve` and `state export` refuse it
/// with the way out, exit 1, print no panic, and leave it byte for byte as it was;
/// `serve --reset-state` then starts from empty statistics.
#[test]
fn a_damaged_state_file_is_refused_untouched_without_a_panic() {
    let dir = fresh_dir("damaged");
    let config = state_config(&dir, 3600.0);
    let state = dir.join("state.redb");
    let cfg = config.to_str().unwrap();
    let (mut child, addr) = serve(&config);
    let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(terminate(&mut child).success());
    let mut bytes = std::fs::read(&state).unwrap();
    assert!(bytes.len() > 8192, "a state file of {} bytes", bytes.len());
    // The first page (redb's header and commit slots) kept; the rest from a 64-bit LCG.
    let mut x: u64 = 0x00e9;
    for b in &mut bytes[4096..] {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *b = (x >> 56) as u8;
    }
    std::fs::write(&state, &bytes).unwrap();
    for args in [
        vec!["state", "export", "--config", cfg],
        vec!["serve", "--config", cfg, "--listen", "127.0.0.1:0"],
    ] {
        let out = equiroute(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot be opened as an Equiroute state file")
                && err.contains("equiroute serve --reset-state"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            std::fs::read(&state).unwrap() == bytes,
            "{args:?} changed the refused file"
        );
    }
    let (mut child, addr) = serve_with(&config, &["--reset-state"]);
    let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(terminate(&mut child).success());
    let out = equiroute(&["state", "export", "--config", cfg]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `state export` before any gateway saved state: "no state saved yet at PATH", exit status
/// 3, nothing on standard output, and no state file created.
#[test]
fn export_with_nothing_saved_says_so_and_creates_nothing() {
    let dir = fresh_dir("nothing");
    let config = state_config(&dir, 3600.0);
    let state = dir.join("state.redb");
    let out = equiroute(&["state", "export", "--config", config.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(
        err.trim(),
        format!("no state saved yet at {}", state.display())
    );
    assert!(out.stdout.is_empty());
    assert!(!state.exists(), "export created the state file");
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

/// Starts `serve` without a configuration, with `XDG_STATE_HOME` (when given) and `HOME` in
/// `dir`, so that it never writes to the real home; returns it with its address and the
/// start-up line that says where learning lives.
fn serve_default(
    dir: &std::path::Path,
    xdg: Option<&std::path::Path>,
    extra: &[&str],
) -> (Child, String, String) {
    let mut cmd = Command::new(bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("HOME", dir.join("home"))
        .env_remove("XDG_STATE_HOME");
    if let Some(xdg) = xdg {
        cmd.env("XDG_STATE_HOME", xdg);
    }
    let (child, lines) = start(&mut cmd, |line| line.starts_with("learning: "));
    let learning = lines.last().unwrap().clone();
    (child, address(&lines), learning)
}

fn get(addr: &str, path: &str) -> serde_json::Value {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The quality scores the default `web_search` interface has learnt, over its providers.
fn scores_learnt(addr: &str) -> u64 {
    let state = get(addr, "/v1/interfaces/web_search/state");
    state["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["estimates"]["quality_observations"].as_u64().unwrap())
        .sum()
}

#[test]
fn without_a_configuration_learning_persists_in_the_users_state_directory() {
    let dir = fresh_dir("zero-config");
    let xdg = dir.join("xdg-state");
    let file = xdg.join("equiroute").join("default.redb");
    let (mut child, addr, learning) = serve_default(&dir, Some(&xdg), &[]);
    assert!(
        learning.starts_with("learning: persists in ")
            && learning.contains(&file.display().to_string()),
        "{learning}"
    );
    assert!(
        learning.contains("--in-memory"),
        "says how to turn it off: {learning}"
    );
    let reply = post(&addr, "/v1/tools/web_search", r#"{"query":"rust"}"#);
    let id = reply
        .lines()
        .find_map(|l| l.strip_prefix("x-equiroute-request-id: "))
        .unwrap_or_else(|| panic!("{reply}"))
        .trim()
        .to_owned();
    let fb = post(
        &addr,
        "/v1/feedback",
        &format!(r#"{{"request_id":"{id}","quality":1.0}}"#),
    );
    assert!(fb.starts_with("HTTP/1.1 200"), "{fb}");
    assert_eq!(scores_learnt(&addr), 1);
    assert!(terminate(&mut child).success());
    assert!(file.exists(), "saved at exit in {}", file.display());

    // The next start restores it.
    let (mut child, addr, _) = serve_default(&dir, Some(&xdg), &[]);
    assert_eq!(scores_learnt(&addr), 1, "learning survived the restart");
    assert!(terminate(&mut child).success());

    // The opt-out: nothing restored, and it says so.
    let (mut child, addr, learning) = serve_default(&dir, Some(&xdg), &["--in-memory"]);
    assert!(
        learning.contains("in memory only (--in-memory)"),
        "{learning}"
    );
    assert_eq!(scores_learnt(&addr), 0);
    assert!(terminate(&mut child).success());

    // Without XDG_STATE_HOME: under $HOME/.local/state.
    let (mut child, addr, learning) = serve_default(&dir, None, &[]);
    let home_file = dir.join("home/.local/state/equiroute/default.redb");
    assert!(
        learning.contains(&home_file.display().to_string()),
        "{learning}"
    );
    // A file of its own: nothing learnt yet (and, answered, the gateway is up to a SIGTERM).
    assert_eq!(scores_learnt(&addr), 0);
    assert!(terminate(&mut child).success());
    assert!(home_file.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
