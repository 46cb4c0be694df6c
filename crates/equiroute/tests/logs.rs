//! The logs of `serve`, through the binary: on stderr, human-readable by default, one JSON
//! object per line with `--log-format json` or `[server] log_format = "json"`; a request's
//! events carry its id; `RUST_LOG` sets the level; standard output keeps its banner.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

mod common;
use common::{post, terminate};

/// Starts `serve --in-memory` on a free port with `args` and `env` (in a state directory of
/// its own), and returns it with its address, read from the banner on standard output.
fn serve(name: &str, args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let dir = std::env::temp_dir().join(format!("equiroute-logs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_equiroute"))
        .args(["serve", "--in-memory", "--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("RUST_LOG")
        .env("XDG_STATE_HOME", &dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    stdout.read_line(&mut banner).unwrap();
    assert!(
        banner.starts_with("equiroute listening on http://"),
        "{banner}"
    );
    let addr = banner["equiroute listening on http://".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    child.stdout = Some(stdout.into_inner());
    (child, addr)
}

/// Stops the gateway with SIGTERM and returns everything it wrote on stderr.
fn stop(mut child: Child) -> String {
    let mut stderr = child.stderr.take().unwrap();
    assert!(terminate(&mut child).success());
    let mut err = String::new();
    stderr.read_to_string(&mut err).unwrap();
    err
}

const CHAT: &str = r#"{"model":"chat","messages":[{"role":"user","content":"hello"}]}"#;

fn json_lines(stderr: &str) -> Vec<serde_json::Value> {
    stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn json_logs_are_one_object_per_line_and_a_request_carries_its_id() {
    let (child, addr) = serve("json", &["--log-format", "json"], &[("RUST_LOG", "debug")]);
    let reply = post(&addr, "/v1/chat/completions", CHAT);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let id = reply
        .lines()
        .find_map(|l| l.strip_prefix("x-equiroute-request-id: "))
        .unwrap()
        .trim()
        .to_owned();
    let lines = json_lines(&stop(child));
    for line in &lines {
        assert!(
            line["level"].is_string() && line["target"].is_string() && line["fields"].is_object(),
            "{line}"
        );
    }
    let message = |l: &serde_json::Value| l["fields"]["message"].as_str().unwrap_or("").to_owned();
    let listening = lines.iter().find(|l| message(l) == "listening").unwrap();
    assert_eq!(listening["level"], "INFO");
    assert_eq!(listening["fields"]["addr"], addr.as_str());
    let ready = lines
        .iter()
        .find(|l| message(l) == "gateway ready")
        .unwrap();
    assert_eq!(ready["fields"]["interfaces"], 2);
    // The request's decision and attempt, inside its span.
    let own: Vec<_> = lines
        .iter()
        .filter(|l| l["span"]["request_id"] == id.as_str())
        .collect();
    assert!(own.iter().any(|l| message(l) == "decided"), "{lines:?}");
    // The embedded providers fail 1–2% of calls: a first attempt may fail and a fallback
    // answer, so the answer's attempt is the one logged `ok`, and every attempt names its
    // outcome.
    let attempts: Vec<_> = own.iter().filter(|l| message(l) == "attempt").collect();
    assert!(
        attempts.iter().all(|a| a["fields"]["outcome"].is_string()),
        "{attempts:?}"
    );
    let answered = attempts
        .iter()
        .find(|a| a["fields"]["outcome"] == "ok")
        .unwrap_or_else(|| panic!("no attempt logged ok: {attempts:?}"));
    assert_eq!(answered["span"]["interface"], "chat");
    // Never a body: the prompt is nowhere in the logs.
    assert!(!lines.iter().any(|l| l.to_string().contains("hello")));
}

#[test]
fn human_logs_are_the_default_and_rust_log_sets_the_level() {
    let (child, addr) = serve("human", &[], &[]);
    assert!(post(&addr, "/v1/chat/completions", CHAT).starts_with("HTTP/1.1 200"));
    let err = stop(child);
    let listening = err.lines().find(|l| l.contains("listening")).unwrap();
    assert!(
        listening.contains("INFO") && !listening.starts_with('{'),
        "{err}"
    );
    // Info is the default level: no per-attempt debug event.
    assert!(!err.contains("DEBUG"), "{err}");

    // `[server] log_format = "json"` from the configuration; `RUST_LOG=warn` keeps only the
    // warning (a rejected feedback), with the id it was given.
    let dir = std::env::temp_dir().join(format!("equiroute-logs-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gw.toml");
    std::fs::write(
        &config,
        "[server]\nlog_format = \"json\"\n[interfaces.search]\nkind = \"tool\"\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n",
    )
    .unwrap();
    let (child, addr) = serve(
        "warn",
        &["--config", config.to_str().unwrap()],
        &[("RUST_LOG", "warn")],
    );
    let reply = post(
        &addr,
        "/v1/feedback",
        r#"{"request_id":"req-none","quality":0.5}"#,
    );
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    let lines = json_lines(&stop(child));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["level"], "WARN");
    assert_eq!(lines[0]["fields"]["request_id"], "req-none");
    let _ = std::fs::remove_dir_all(&dir);
}
