//! `equiroute replay` through the binary: a gateway serves traffic under a uniformly random
//! policy with its audit log on, the test scores every answer by who gave it (0.9, 0.6,
//! 0.2), and the replay's estimates of other policies are checked against what those scores
//! make them by hand; then a hand-written log checks the numbers of IPS exactly, the
//! warnings (deterministic logger, a candidate never chosen, no features), malformed lines
//! and the errors of bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

mod common;
use common::{post, terminate};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_equiroute")
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-replay-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Starts `serve --config` on a free port; returns it with its address (from the banner).
fn serve(config: &Path, dir: &Path) -> (Child, String) {
    let mut child = Command::new(bin())
        .args(["serve", "--in-memory", "--config", config.to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "error")
        .env("XDG_STATE_HOME", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let addr = address(&mut stdout);
    child.stdout = Some(stdout.into_inner());
    (child, addr.expect("serve did not start"))
}

/// The address of the line that says where the gateway listens; `None` at the end of output.
fn address(stdout: &mut impl BufRead) -> Option<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if stdout.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some((_, rest)) = line.split_once("http://") {
            return rest.split_whitespace().next().map(str::to_owned);
        }
    }
}

fn replay(args: &[&str]) -> Output {
    Command::new(bin())
        .arg("replay")
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

/// `replay`'s output, which must succeed.
fn replay_text(args: &[&str]) -> String {
    let o = replay(args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// `replay`'s report, which must succeed (the arguments ask for `--format json`).
fn replay_json(args: &[&str]) -> Value {
    serde_json::from_str(&replay_text(args)).unwrap()
}

fn header<'a>(reply: &'a str, name: &str) -> Option<&'a str> {
    reply
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

/// The embedded default's two interfaces with fast simulated providers (the same prices),
/// `chat` under a uniformly random policy, and the audit log keeping full features.
fn config(dir: &Path) -> PathBuf {
    let audit = dir.join("audit.jsonl");
    let text = format!(
        r#"
[audit]
path = {audit:?}
features = "full"

[interfaces.chat]
kind = "chat"
policy = "random"
deadline_ms = 6000

[[interfaces.chat.providers]]
id = "sim-standard"
kind = "sim"
model = "sim-model"
price = {{ per_million_input_tokens = 0.12, per_million_output_tokens = 0.50 }}
sim = {{ latency = {{ p50_ms = 2, p95_ms = 5 }} }}

[[interfaces.chat.providers]]
id = "sim-flex"
kind = "sim"
model = "sim-model"
tier = "flex"
price = {{ per_million_input_tokens = 0.06, per_million_output_tokens = 0.25 }}
sim = {{ latency = {{ p50_ms = 2, p95_ms = 5 }} }}

[[interfaces.chat.providers]]
id = "sim-small"
kind = "sim"
model = "sim-small"
price = {{ per_million_input_tokens = 0.02, per_million_output_tokens = 0.08 }}
sim = {{ latency = {{ p50_ms = 1, p95_ms = 3 }} }}

[interfaces.web_search]
kind = "tool"
policy = {{ name = "lqm" }}
deadline_ms = 2000

[[interfaces.web_search.providers]]
id = "sim-search-fast"
kind = "sim"
price = {{ per_call = 0.008 }}
sim = {{ latency = {{ p50_ms = 1, p95_ms = 3 }} }}

[[interfaces.web_search.providers]]
id = "sim-search-tight"
kind = "sim"
price = {{ per_call = 0.003 }}
sim = {{ latency = {{ p50_ms = 3, p95_ms = 5 }} }}
"#,
        audit = audit.display().to_string()
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The score the test gives an answer, by the provider that gave it.
fn quality_of(provider: &str) -> f64 {
    match provider {
        "sim-standard" => 0.9,
        "sim-flex" => 0.6,
        _ => 0.2,
    }
}

fn metric<'a>(policy: &'a Value, estimator: &str, key: &str) -> &'a Value {
    let e = policy["estimates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["estimator"] == estimator)
        .unwrap_or_else(|| panic!("no {estimator} estimate in {policy}"));
    &e["metrics"][key]
}

fn value(v: &Value) -> f64 {
    v["value"]
        .as_f64()
        .unwrap_or_else(|| panic!("no value in {v}"))
}

/// Serves 90 chat requests (each scored by who answered) and 12 web searches; returns the
/// audit log and how often each chat provider was chosen.
fn serve_scored_traffic(dir: &Path, config: &Path) -> (PathBuf, BTreeMap<String, usize>) {
    let (mut child, addr) = serve(config, dir);
    let mut chosen = BTreeMap::<String, usize>::new();
    for n in 0..90 {
        let body = format!(
            r#"{{"model":"chat","messages":[{{"role":"user","content":"question number {n} about topic {}"}}]}}"#,
            n % 7
        );
        let reply = post(&addr, "/v1/chat/completions", &body);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let id = header(&reply, "x-equiroute-request-id").unwrap();
        let provider = header(&reply, "x-equiroute-provider").unwrap();
        *chosen.entry(provider.to_owned()).or_default() += 1;
        let fb = post(
            &addr,
            "/v1/feedback",
            &format!(
                r#"{{"request_id":"{id}","quality":{},"source":"user"}}"#,
                quality_of(provider)
            ),
        );
        assert!(fb.starts_with("HTTP/1.1 200"), "{fb}");
    }
    for _ in 0..12 {
        let reply = post(&addr, "/v1/tools/web_search", r#"{"query":"rust"}"#);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }
    assert!(terminate(&mut child).success());
    (dir.join("audit.jsonl"), chosen)
}

/// The log: one request line per request (propensity and its kind, the eligible set, the
/// features, the deadline), one feedback line per score.
fn check_the_log(audit: &Path) {
    let lines: Vec<Value> = std::fs::read_to_string(audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let requests: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "request").collect();
    let feedback: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "feedback").collect();
    assert_eq!((requests.len(), feedback.len()), (102, 90));
    let chat = requests.iter().find(|r| r["interface"] == "chat").unwrap();
    assert_eq!(chat["propensity"], 1.0 / 3.0);
    assert_eq!(chat["propensity_kind"], "exact");
    assert_eq!(chat["eligible"].as_array().unwrap().len(), 3);
    assert_eq!(chat["features"].as_array().unwrap().len(), 64);
    assert!(chat["features_hash"].is_null(), "full features, no digest");
    assert_eq!(chat["deadline_ms"], 6000.0);
    assert_eq!(chat["deadline_miss"], false);
    assert_eq!(feedback[0]["source"], "user");
    let search = requests
        .iter()
        .find(|r| r["interface"] == "web_search")
        .unwrap();
    assert_eq!(search["propensity_kind"], "deterministic");
}

fn policy_of(iface: &Value, name: &str) -> Value {
    iface["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == name)
        .unwrap()
        .clone()
}

/// The replay's JSON for `chat`, checked against what the scores make it by hand.
fn check_chat(chat: &Value, chosen: &BTreeMap<String, usize>) {
    assert_eq!(chat["requests"], 90);
    assert_eq!(chat["with_quality"], 90);
    assert_eq!(chat["logging"]["propensities"], "exact");
    // The random policy's own mean quality: the scores of what it chose.
    let expected: f64 = chosen
        .iter()
        .map(|(p, n)| quality_of(p) * *n as f64)
        .sum::<f64>()
        / 90.0;
    let logged = value(&chat["logging"]["on_policy"]["quality"]);
    assert!((logged - expected).abs() < 1e-9, "{logged} vs {expected}");
    // `static` always puts sim-standard first: every request it would weigh scored 0.9, so
    // SNIPS is 0.9 exactly, and IPS and DR are 0.9 within their noise.
    let stat = policy_of(chat, "static");
    assert!(stat["refused"].is_null(), "{stat}");
    let snips = metric(&stat, "snips", "quality");
    assert!((value(snips) - 0.9).abs() < 1e-9, "{snips}");
    // IPS divides by the 90 requests, not by the weights: 0.9 × 3 × (random's picks of
    // sim-standard) / 90, whatever that count came out as (30 expected; a tolerance around
    // 0.9 failed on unlucky draws).
    let ips = value(metric(&stat, "ips", "quality"));
    let by_hand = 0.9 * 3.0 * chosen["sim-standard"] as f64 / 90.0;
    assert!(
        (ips - by_hand).abs() < 1e-9,
        "{ips} vs {by_hand}: {chosen:?}"
    );
    for estimator in ["ips", "dr"] {
        let q = metric(&stat, estimator, "quality");
        if estimator == "dr" {
            assert!((value(q) - 0.9).abs() < 0.3, "{estimator}: {q}");
        }
        let (low, high) = (
            q["ci_low"].as_f64().unwrap(),
            q["ci_high"].as_f64().unwrap(),
        );
        assert!(low <= value(q) && value(q) <= high, "{q}");
    }
    // Its weights are 3 on the requests random sent to sim-standard, 0 elsewhere: the
    // effective sample size is that count.
    let ess = snips["effective_sample_size"].as_f64().unwrap();
    let standard = chosen["sim-standard"] as f64;
    assert!((ess - standard).abs() < 1e-6, "{ess} vs {chosen:?}");
    // `cheapest` puts sim-small first: quality 0.2, and cheaper per request than `static`.
    let cheap = policy_of(chat, "cheapest");
    assert!((value(metric(&cheap, "snips", "quality")) - 0.2).abs() < 1e-9);
    assert!(
        value(metric(&cheap, "snips", "cost_per_request_usd"))
            < value(metric(&stat, "snips", "cost_per_request_usd"))
    );
    assert!(value(metric(&cheap, "snips", "deadline_miss_rate")).abs() < 1e-12);
    // A contextual policy is evaluated from full features: a quality between the worst and
    // the best provider.
    let lqm_ts = policy_of(chat, "lqm-ts");
    assert!(lqm_ts["refused"].is_null(), "{lqm_ts}");
    let q = value(metric(&lqm_ts, "dr", "quality"));
    assert!((0.0..=1.0).contains(&q), "{q}");
}

#[test]
fn serve_then_replay_estimates_other_policies_from_the_audit_log() {
    let dir = fresh_dir("serve");
    let config = config(&dir);
    let (audit, chosen) = serve_scored_traffic(&dir, &config);
    assert_eq!(chosen.len(), 3, "random tries every provider: {chosen:?}");
    check_the_log(&audit);
    let (config_arg, audit_arg) = (config.to_str().unwrap(), audit.to_str().unwrap());
    let report = replay_json(&[
        "--audit",
        audit_arg,
        "--config",
        config_arg,
        "--policies",
        "static,cheapest,lqm-ts",
        "--set",
        "static.candidate=sim-standard",
        "--estimator",
        "all",
        "--format",
        "json",
    ]);
    assert_eq!(report["malformed_lines"], 0);
    let ifaces = report["interfaces"].as_array().unwrap();
    check_chat(
        ifaces.iter().find(|i| i["interface"] == "chat").unwrap(),
        &chosen,
    );
    // web_search was logged by a deterministic policy (lqm): said once, and a policy that
    // names a provider the interface lacks is refused there, not fatal.
    let search = ifaces
        .iter()
        .find(|i| i["interface"] == "web_search")
        .unwrap();
    assert_eq!(search["logging"]["propensities"], "deterministic");
    let warnings = search["warnings"].to_string();
    assert!(warnings.contains("is deterministic"), "{warnings}");
    let refused = search["policies"][0]["refused"].as_str().unwrap();
    assert!(refused.contains("sim-standard"), "{refused}");

    // The same as a table.
    let text = replay_text(&[
        "--audit",
        audit_arg,
        "--config",
        config_arg,
        "--policies",
        "static,cheapest",
        "--set",
        "static.candidate=sim-standard",
        "--interface",
        "chat",
    ]);
    let head = "interface `chat`: 90 requests (90 with a quality score), logged by random (propensities exact)";
    assert!(text.contains(head), "{text}");
    assert!(text.contains("random (logged)  on-policy"), "{text}");
    let row = |l: &&str| l.trim_start().starts_with("static") && l.contains(" dr ");
    let stat = text.lines().find(row).unwrap_or_else(|| panic!("{text}"));
    assert!(stat.contains("0.900 ["), "{stat}");
    assert!(
        !text.contains("web_search"),
        "--interface keeps one: {text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request line of a hand-written log over candidates `a` and `b`.
fn line(
    iface: &str,
    id: usize,
    chose: &str,
    propensity: f64,
    kind: &str,
    ok: bool,
    cost: f64,
) -> String {
    let other = if chose == "a" { "b" } else { "a" };
    let status = if ok { "ok" } else { "provider_error" };
    format!(
        r#"{{"kind":"request","ts_ms":{ts},"decided_ms":{t0},"request_id":"{iface}-{id}","interface":"{iface}","policy":"hand","candidates":["a","b"],"eligible":["a","b"],"excluded":[],"scores":[],"order":["{chose}","{other}"],"propensity":{propensity},"propensity_kind":"{kind}","features_hash":"00000000000000ff","attempts":[{{"provider":"{chose}","status":"{status}","started_ms":{t0},"latency_ms":10.0,"cost_usd":{cost}}}],"outcome":"{outcome}","fallback_reason":null,"latency_ms":10.0,"cost_usd":{cost},"deadline_ms":1000.0,"deadline_miss":false,"failed":{failed}}}"#,
        ts = 1000 * id + 10,
        t0 = 1000 * id,
        outcome = if ok { "ok" } else { "failed" },
        failed = !ok,
    )
}

#[test]
fn a_hand_written_log_gives_the_ips_numbers_by_hand_and_every_warning() {
    let dir = fresh_dir("hand");
    // `uniform`: a fair coin between a and b (propensity 0.5): a always succeeds and costs
    // 1, b always fails and costs 3. IPS of `static` on b: (0 + 2·3 + 0 + 2·3)/4 = 3 per
    // request, bad rate (0 + 2 + 0 + 2)/4 = 1; on a: cost (2·1 + 0 + 2·1 + 0)/4 = 1.
    let mut text: Vec<String> = (0..4)
        .map(|i| {
            let a = i % 2 == 0;
            line(
                "uniform",
                i,
                if a { "a" } else { "b" },
                0.5,
                "exact",
                a,
                if a { 1.0 } else { 3.0 },
            )
        })
        .collect();
    // `fixed`: a deterministic logger that always chose a.
    text.extend((0..4).map(|i| line("fixed", i, "a", 1.0, "deterministic", true, 1.0)));
    text.push(r#"{"kind":"request","ts_ms": 5"#.to_owned());
    let audit = dir.join("audit.jsonl");
    std::fs::write(&audit, text.join("\n")).unwrap();
    let audit_arg = audit.to_str().unwrap();
    let report = replay_json(&[
        "--audit",
        audit_arg,
        "--policies",
        "static,lqm",
        "--set",
        "static.candidate=b",
        "--estimator",
        "ips",
        "--format",
        "json",
    ]);
    assert_eq!(report["malformed_lines"], 1);
    assert!(
        report["notes"][0]
            .as_str()
            .unwrap()
            .contains("audit.jsonl:9: not JSON"),
        "{report}"
    );
    let iface = |name: &str| {
        report["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["interface"] == name)
            .unwrap()
            .clone()
    };
    let uniform = iface("uniform");
    assert!(uniform["candidates_from"]
        .as_str()
        .unwrap()
        .contains("log alone"));
    let stat = &uniform["policies"][0];
    assert!((value(metric(stat, "ips", "cost_per_request_usd")) - 3.0).abs() < 1e-12);
    assert!((value(metric(stat, "ips", "bad_outcome_rate")) - 1.0).abs() < 1e-12);
    assert_eq!(
        metric(stat, "ips", "quality")["n"],
        0,
        "no score in this log"
    );
    // lqm reads features; this log kept only their digest.
    let lqm = uniform["policies"][1]["refused"].as_str().unwrap();
    assert!(lqm.contains("only context-free policies"), "{lqm}");
    assert!(lqm.contains("features = \"full\""), "{lqm}");
    // The deterministic logger never chose b: both warnings, b named.
    let fixed = iface("fixed");
    assert!(fixed["warnings"][0]
        .as_str()
        .unwrap()
        .contains("is deterministic"));
    let never = fixed["policies"][0]["warnings"].to_string();
    assert!(
        never.contains("would put `b` first on 100.0% of requests, but the log never chose it"),
        "{never}"
    );
    // And `static` on a, checked in the table.
    let o = replay(&[
        "--audit",
        audit_arg,
        "--policies",
        "static",
        "--set",
        "static.candidate=a",
        "--estimator",
        "ips",
        "--interface",
        "uniform",
    ]);
    let table = String::from_utf8(o.stdout).unwrap();
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with("static"))
        .unwrap();
    assert!(row.contains("1.00 ["), "cost 1 per request: {row}");
    assert!(table.contains("1 malformed line(s) skipped"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_named_with_its_fix() {
    let dir = fresh_dir("bad");
    let audit = dir.join("audit.jsonl");
    std::fs::write(&audit, line("x", 0, "a", 0.5, "exact", true, 1.0)).unwrap();
    let audit_arg = audit.to_str().unwrap();
    let missing = dir.join("nope.jsonl");
    for (args, says) in [
        (
            vec!["--audit", missing.to_str().unwrap(), "--policies", "static"],
            "nope.jsonl`: no such file",
        ),
        (vec!["--audit", audit_arg, "--policies", "bogus"], "bogus"),
        (
            vec![
                "--audit",
                audit_arg,
                "--policies",
                "static",
                "--set",
                "static",
            ],
            "write POLICY.FIELD=VALUE",
        ),
        (
            vec![
                "--audit",
                audit_arg,
                "--policies",
                "static",
                "--set",
                "lqm.l_ref_ms=5",
            ],
            "`lqm` is not one of --policies",
        ),
        (
            vec![
                "--audit",
                audit_arg,
                "--policies",
                "lqm",
                "--set",
                "lqm.l_ref_ms=\"fast\"",
            ],
            "l_ref_ms",
        ),
        (
            vec![
                "--audit",
                audit_arg,
                "--policies",
                "lqm",
                "--interface",
                "chat",
            ],
            "--interface `chat`",
        ),
    ] {
        let o = replay(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(err.starts_with("Error: "), "one message: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A coin-flip log (propensity 0.5) over `a` and `b` in which `a`'s cost grows with its
/// share of the previous 50 requests (1 + 4·share, plus a little noise), `b` costing 1.
fn load_dependent_log(n: usize) -> String {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut chose_a: Vec<bool> = Vec::new();
    let mut lines = Vec::new();
    for i in 0..n {
        let a = next() < 0.5;
        let recent = &chose_a[chose_a.len().saturating_sub(50)..];
        let share = recent.iter().filter(|x| **x).count() as f64 / 50.0;
        let cost = if a {
            1.0 + 4.0 * share + 0.05 * next()
        } else {
            1.0
        };
        lines.push(line(
            "pool",
            i,
            if a { "a" } else { "b" },
            0.5,
            "exact",
            true,
            cost,
        ));
        chose_a.push(a);
    }
    lines.join("\n")
}

#[test]
fn a_load_warning_names_the_provider_by_its_id() {
    let dir = fresh_dir("load");
    let audit = dir.join("audit.jsonl");
    std::fs::write(&audit, load_dependent_log(400)).unwrap();
    let audit_arg = audit.to_str().unwrap();
    let args = [
        "--audit",
        audit_arg,
        "--policies",
        "static",
        "--set",
        "static.candidate=a",
        "--estimator",
        "ips",
    ];
    // `static` on `a` sends it every request where the coin sent it half: its cost under
    // that load is not in the log.
    let report = replay_json(&[&args[..], &["--format", "json"]].concat());
    let warnings = report["interfaces"][0]["policies"][0]["warnings"].to_string();
    assert!(
        warnings.contains("`a`'s outcome depends on how much traffic it gets"),
        "{warnings}"
    );
    for index in ["candidate 0", "candidate 1"] {
        assert!(!warnings.contains(index), "{index} in {warnings}");
    }
    let table = replay_text(&args);
    assert!(
        table.contains("- static: `a`'s outcome depends on how much traffic it gets"),
        "{table}"
    );
    assert!(!table.contains("candidate 0"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request line like [`line`]'s (a coin flip between `a` and `b`, propensity 0.5) that
/// took `latency` ms against a deadline of 100 ms.
fn timed_line(id: usize, chose: &str, latency: f64) -> String {
    let mut v: Value = serde_json::from_str(&line("pool", id, chose, 0.5, "exact", true, 1.0))
        .expect("line writes JSON");
    v["ts_ms"] = serde_json::json!(1000.0 * id as f64 + latency);
    v["latency_ms"] = serde_json::json!(latency);
    v["attempts"][0]["latency_ms"] = serde_json::json!(latency);
    v["deadline_ms"] = serde_json::json!(100.0);
    v["deadline_miss"] = serde_json::json!(latency > 100.0);
    v.to_string()
}

/// 400 coin flips between `a` and `b`: for the first 200 requests `a` answers in 50 ms
/// and `b` in 200 (past the 100 ms deadline), for the last 200 `a` in 150 (past it) and `b`
/// in 20.
fn switching_latency_log() -> String {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..400)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let a = (state >> 40) & 1 == 0;
            let latency = match (i < 200, a) {
                (true, true) => 50.0,
                (true, false) => 200.0,
                (false, true) => 150.0,
                (false, false) => 20.0,
            };
            timed_line(i, if a { "a" } else { "b" }, latency)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_policy_whose_value_depends_on_what_it_learns_is_warned_and_a_fixed_one_is_not() {
    let dir = fresh_dir("learning");
    let audit = dir.join("audit.jsonl");
    std::fs::write(&audit, switching_latency_log()).unwrap();
    let audit_arg = audit.to_str().unwrap();
    // `least-latency` learning from every logged request follows the switch (a, then b)
    // and misses almost no deadline; learning only from its own choices it never sees `b`
    // again after its slow start and stays on `a`, missing the second half's deadlines.
    // `static` on `a` learns nothing: one replay is the other.
    let args = [
        "--audit",
        audit_arg,
        "--policies",
        "least-latency,static",
        "--set",
        "static.candidate=a",
        "--estimator",
        "ips",
    ];
    let report = replay_json(&[&args[..], &["--format", "json"]].concat());
    let iface = &report["interfaces"][0];
    let says =
        "the evaluated policy learns from the traffic, and the estimate depends on what it learns";
    let least = policy_of(iface, "least-latency");
    let warnings = least["warnings"].to_string();
    assert!(
        warnings.contains(&format!("deadline_miss_rate (ips): {says}")),
        "{warnings}"
    );
    // The estimate is the replay learning from everything; its interval spans the other.
    let miss = metric(&least, "ips", "deadline_miss_rate");
    assert!(value(miss) < 0.1, "{miss}");
    assert!(miss["ci_high"].as_f64().unwrap() > 0.4, "{miss}");
    // Learning from a random sample of the same size it follows the switch: the comparison
    // that fired is its own traffic against that sample, and the warning says so.
    assert!(warnings.contains("uniformly random sample"), "{warnings}");
    let fixed = policy_of(iface, "static");
    let warnings = fixed["warnings"].to_string();
    assert!(!warnings.contains(says), "{warnings}");
    // `static` on `a` misses the second half's deadlines: about half.
    let miss = value(metric(&fixed, "ips", "deadline_miss_rate"));
    assert!((miss - 0.5).abs() < 0.15, "{miss}");
    // The table says it under the policy's name.
    let o = replay(&args);
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(
        table.contains(&format!(
            "- least-latency: deadline_miss_rate (ips): {says}"
        )),
        "{table}"
    );
    assert!(
        !table.contains(&format!("- static: deadline_miss_rate (ips): {says}")),
        "{table}"
    );
    // The check before the random-sample replay warns too, naming only its two replays.
    let report = replay_json(
        &[
            &args[..],
            &["--format", "json", "--learning-check", "all-vs-own"],
        ]
        .concat(),
    );
    let warnings = policy_of(&report["interfaces"][0], "least-latency")["warnings"].to_string();
    assert!(warnings.contains(says), "{warnings}");
    assert!(!warnings.contains("random sample"), "{warnings}");
    let _ = std::fs::remove_dir_all(&dir);
}
