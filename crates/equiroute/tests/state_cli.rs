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
    config_with_state(
        dir,
        "",
        snapshot_interval_s,
        "[interfaces.search]\nkind = \"tool\"\npolicy = { name = \"lqm\" }\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n",
    )
}

/// `dir/gw.toml`: `head`, a `[state]` in `dir/state.redb`, then `interfaces`.
fn config_with_state(
    dir: &std::path::Path,
    head: &str,
    snapshot_interval_s: f64,
    interfaces: &str,
) -> std::path::PathBuf {
    let config = dir.join("gw.toml");
    let path = dir.join("state.redb").display().to_string();
    std::fs::write(
        &config,
        format!("{head}[state]\npath = {path:?}\nsnapshot_interval_s = {snapshot_interval_s:?}\n{interfaces}"),
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
    let out = common::get(addr, path);
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

/// The file's bytes and modification time: what "untouched" means.
fn fingerprint(path: &std::path::Path) -> (Vec<u8>, std::time::SystemTime) {
    let meta = std::fs::metadata(path).unwrap();
    (std::fs::read(path).unwrap(), meta.modified().unwrap())
}

/// Serves `config` for `requests` tool calls, then stops it with SIGTERM (the last snapshot).
fn learn(config: &std::path::Path, requests: usize) {
    let (mut child, addr) = serve(config);
    for _ in 0..requests {
        let reply = post(&addr, "/v1/tools/search", r#"{"query":"rust"}"#);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }
    assert!(terminate(&mut child).success());
}

/// Follows `child`'s stderr (the logs) on a thread of its own, line by line.
fn log_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first log line (within 20 s) that contains `needle`.
fn wait_log(lines: &std::sync::mpsc::Receiver<String>, needle: &str) -> String {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(_) => {}
            Err(e) => panic!("no log line with `{needle}` within 20 s ({e})"),
        }
    }
}

/// `state import` refuses, untouched, what `serve` would refuse: a snapshot of another
/// configuration (which used to import, after which the gateway refused to start) and a file
/// that is no snapshot; and neither error advises `--reset-state`, which would delete the
/// good file. The gateway still starts on the file afterwards.
#[test]
fn a_refused_import_leaves_the_state_file_untouched_and_advises_nothing_destructive() {
    let one = fresh_dir("import-one");
    let two = fresh_dir("import-two");
    let one_config = state_config(&one, 3600.0);
    let two_config = state_config(&two, 3600.0);
    // The second configuration has one provider more.
    let text = std::fs::read_to_string(&two_config).unwrap();
    std::fs::write(
        &two_config,
        format!("{text}[[interfaces.search.providers]]\nid = \"s2\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n"),
    )
    .unwrap();
    learn(&one_config, 5);
    learn(&two_config, 5);
    let exported = equiroute(&["state", "export", "--config", one_config.to_str().unwrap()]);
    assert!(exported.status.success());
    let other = one.join("other.json");
    std::fs::write(&other, &exported.stdout).unwrap();
    let junk = one.join("junk.json");
    std::fs::write(&junk, br#"{"interfaces": "no"}"#).unwrap();
    let live = two.join("state.redb");
    let before = fingerprint(&live);
    for (file, says) in [
        (&other, "another configuration"),
        (&junk, "not an Equiroute state snapshot"),
    ] {
        let out = equiroute(&[
            "state",
            "import",
            "--config",
            two_config.to_str().unwrap(),
            file.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains(says) && stderr.contains("was not changed"),
            "{stderr}"
        );
        assert!(!stderr.contains("--reset-state"), "{stderr}");
        let after = fingerprint(&live);
        assert!(
            before.0 == after.0,
            "a refused import changed the file's bytes"
        );
        assert_eq!(
            before.1, after.1,
            "a refused import changed the file's time"
        );
    }
    let (mut child, _) = serve(&two_config);
    assert!(terminate(&mut child).success());
    let _ = std::fs::remove_dir_all(&one);
    let _ = std::fs::remove_dir_all(&two);
}

/// The start-up log's `snapshot_age_s` is the age of the snapshot, read before the open (it
/// used to be read after the open had written the file, so it was always 0).
#[test]
fn the_start_up_log_gives_the_snapshots_age() {
    let dir = fresh_dir("age");
    let config = state_config(&dir, 3600.0);
    learn(&config, 3);
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(dir.join("state.redb"))
        .unwrap()
        .set_modified(an_hour_ago)
        .unwrap();
    let (mut child, _) = serve(&config);
    let lines = log_lines(&mut child);
    let line = wait_log(&lines, "learning state file opened");
    let age: u64 = line
        .split("snapshot_age_s=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("{line}"))
        .parse()
        .unwrap();
    assert!((3600..3700).contains(&age), "{line}");
    assert!(terminate(&mut child).success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A mock upstream whose chat answers are endless streams (a 16 KiB chunk every 50 ms), and a
/// gateway configuration in `dir` that routes chat to it, with its state file and
/// `server.shutdown_grace_ms = grace_ms`. Returns the mock and the configuration.
fn endless_setup(dir: &std::path::Path, grace_ms: u64) -> (Child, std::path::PathBuf) {
    let profile = dir.join("mock.toml");
    std::fs::write(
        &profile,
        "[chat]\nfault = \"endless_stream\"\nchunk_gap_ms = 50\n",
    )
    .unwrap();
    let (mock, lines) = start(
        Command::new(bin()).args([
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--profile",
            profile.to_str().unwrap(),
        ]),
        |line| line.contains("http://"),
    );
    let upstream = address(&lines);
    let config = config_with_state(
        dir,
        &format!("[server]\nshutdown_grace_ms = {grace_ms}\n"),
        3600.0,
        &format!("[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"m\"\nkind = \"openai\"\nmodel = \"endless\"\nbase_url = \"http://{upstream}/v1\"\n"),
    );
    (mock, config)
}

/// Opens a streamed chat request on `addr` and returns its connection once the first bytes of
/// the answer have arrived, with a thread that reads the rest until the gateway closes it.
fn open_endless_stream(addr: &str) -> std::thread::JoinHandle<String> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let body = r#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"go on"}]}"#;
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut first = [0u8; 4096];
    let n = s.read(&mut first).unwrap();
    let head = String::from_utf8_lossy(&first[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    std::thread::spawn(move || {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        // The end of the stream: what came last.
        let tail = &rest[rest.len().saturating_sub(2048)..];
        String::from_utf8_lossy(tail).into_owned()
    })
}

/// Waits (at most `limit`) for `child` to exit; its status and how long that took.
fn exit_within(
    child: &mut Child,
    limit: std::time::Duration,
) -> (std::process::ExitStatus, std::time::Duration) {
    let began = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, began.elapsed());
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the gateway did not exit within {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn signal(child: &Child, name: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// Checks that the stopped gateway of `config` left a snapshot, then stops `mock` and removes
/// `dir`.
fn snapshot_saved_then_clean_up(config: &std::path::Path, mock: &mut Child, dir: &std::path::Path) {
    let exported = equiroute(&["state", "export", "--config", config.to_str().unwrap()]);
    assert!(
        exported.status.success(),
        "no snapshot saved: {}",
        String::from_utf8_lossy(&exported.stderr)
    );
    let _ = mock.kill();
    let _ = mock.wait();
    let _ = std::fs::remove_dir_all(dir);
}

/// Bar 4 of issue 43: SIGTERM with an endless stream open drains for
/// `server.shutdown_grace_ms`, then ends the stream with an error event, saves the snapshot
/// and exits (it used to wait for the stream for ever).
#[test]
fn sigterm_with_an_endless_stream_open_exits_within_the_grace_with_the_snapshot_saved() {
    let dir = fresh_dir("grace");
    let (mut mock, config) = endless_setup(&dir, 1500);
    let (mut child, addr) = serve(&config);
    let stream = open_endless_stream(&addr);
    signal(&child, "TERM");
    let (status, took) = exit_within(&mut child, std::time::Duration::from_secs(20));
    eprintln!("exited {took:?} after SIGTERM (shutdown_grace_ms = 1500)");
    assert!(status.success(), "{status:?}");
    // The grace, the second given to the error event, and the snapshot.
    assert!(
        took >= std::time::Duration::from_millis(1400)
            && took < std::time::Duration::from_millis(4500),
        "{took:?}"
    );
    let tail = stream.join().unwrap();
    assert!(tail.contains(r#""code":"shutting_down""#), "{tail}");
    snapshot_saved_then_clean_up(&config, &mut mock, &dir);
}

/// A second stop signal (SIGINT after SIGTERM) during a long grace ends the drain at once:
/// the snapshot is saved and the gateway exits (both used to be ignored).
#[test]
fn a_second_signal_during_the_drain_exits_at_once_after_the_snapshot() {
    let dir = fresh_dir("second-signal");
    let (mut mock, config) = endless_setup(&dir, 60_000);
    let (mut child, addr) = serve(&config);
    let lines = log_lines(&mut child);
    let _stream = open_endless_stream(&addr);
    signal(&child, "TERM");
    wait_log(&lines, "draining");
    signal(&child, "INT");
    let (status, took) = exit_within(&mut child, std::time::Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
    assert!(took < std::time::Duration::from_secs(3), "{took:?}");
    snapshot_saved_then_clean_up(&config, &mut mock, &dir);
}
