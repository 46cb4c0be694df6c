//! `SIGHUP` reloads the configuration of `equiroute serve` from its file (issue 46): a changed
//! file applies, a broken one is refused and the running configuration keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{get, terminate};

/// `serve --config path --in-memory` on a free port, and its address from the banner.
fn serve(config: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_equiroute"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0", "--in-memory"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve did not start");
        }
        if let Some((_, rest)) = line.split_once("http://") {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    child.stdout = Some(stdout.into_inner());
    (child, addr)
}

fn hang_up(child: &Child) {
    let sent = Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// Polls `GET path` until `done` accepts its answer (10 s at most).
fn wait_for(addr: &str, path: &str, done: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = get(addr, path);
        if done(&answer) {
            return answer;
        }
        assert!(Instant::now() < until, "never: {answer}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn provider(id: &str) -> String {
    format!("[[interfaces.chat.providers]]\nid = \"{id}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n")
}

#[test]
fn sighup_applies_a_changed_file_and_refuses_a_broken_one() {
    let path = std::env::temp_dir().join(format!("equiroute-sighup-{}.toml", std::process::id()));
    let head = "[interfaces.chat]\nkind = \"chat\"\n";
    std::fs::write(&path, format!("{head}{}", provider("a"))).unwrap();
    let (mut child, addr) = serve(&path);
    assert!(!get(&addr, "/v1/models").contains("chat/b"));

    std::fs::write(&path, format!("{head}{}{}", provider("a"), provider("b"))).unwrap();
    hang_up(&child);
    wait_for(&addr, "/v1/models", |m| m.contains("\"chat/b\""));
    let metrics = get(&addr, "/metrics");
    assert!(
        metrics.contains("equiroute_config_reloads_total{outcome=\"applied\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("equiroute_config_version 2"), "{metrics}");

    // A broken file: refused, counted, and `b` still served.
    std::fs::write(
        &path,
        format!(
            "{head}{}",
            provider("a").replace("kind = \"sim\"", "kind = \"simm\"")
        ),
    )
    .unwrap();
    hang_up(&child);
    wait_for(&addr, "/metrics", |m| {
        m.contains("equiroute_config_reloads_total{outcome=\"refused\"} 1")
    });
    assert!(get(&addr, "/v1/models").contains("\"chat/b\""));
    assert!(get(&addr, "/metrics").contains("equiroute_config_version 2"));

    assert!(terminate(&mut child).success());
    let _ = std::fs::remove_file(&path);
}
