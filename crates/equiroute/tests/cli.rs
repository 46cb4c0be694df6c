//! The binary as a user runs it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn equiroute(args: &[&str]) -> std::process::Output {
    equiroute_with_env(args, &[])
}

fn equiroute_with_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_equiroute"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn bench_json_follows_the_documented_schema_and_writes_plots() {
    let out = temp_dir("json");
    let o = equiroute(&[
        "bench",
        "--scenario",
        "near-ties",
        "--policies",
        "lqm-ts,round-robin",
        "--seeds",
        "2",
        "--rounds",
        "300",
        "--format",
        "json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["scenario"], "near-ties");
    assert_eq!(v["seeds"], 2);
    assert_eq!(v["rounds"], 300);
    for policy in ["lqm-ts", "round-robin"] {
        let p = &v["policies"][policy];
        for metric in [
            "quality",
            "latency_mean_ms",
            "latency_p95_ms",
            "deadline_miss_rate",
            "request_failure_rate",
            "attempt_failure_rate",
            "cost_per_request",
            "regret",
        ] {
            assert!(
                p[metric]["mean"].is_number() && p[metric]["ci95"].is_number(),
                "{policy}.{metric}"
            );
        }
        let share: f64 = p["share"]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .sum();
        assert!((share - 1.0).abs() < 1e-9);
    }
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(written, v);
    for file in [
        "near-ties-frontier.svg",
        "near-ties-frontier.png",
        "near-ties-regret.png",
        "near-ties-share-lqm-ts.png",
        "results.csv",
        "table.txt",
    ] {
        let bytes = std::fs::read(out.join(file)).unwrap();
        assert!(bytes.len() > 100, "{file}");
    }
    assert!(std::fs::read(out.join("near-ties-frontier.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_input_names_the_field_and_exits_non_zero() {
    let dir = temp_dir("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("s.toml");
    std::fs::write(
        &file,
        "name = \"x\"\ndescription = \"d\"\nrounds = 10\nmetric = \"f1\"\nclusters = 1\npolicies = [\"lqm\"]\n\n[[providers]]\nid = \"a\"\nquality = [1.5]\nlatency = { p50_ms = 10, p95_ms = 20 }\n",
    )
    .unwrap();
    let o = equiroute(&[
        "bench",
        "--scenario-file",
        file.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("providers[0] (a).quality") && err.contains("between 0 and 1"),
        "{err}"
    );

    let o = equiroute(&[
        "bench",
        "--scenario",
        "near-ties",
        "--policies",
        "lqmx",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("lqmx") && err.contains("equiroute policies"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A user's mistake is an error message and exit status 1, never a stack backtrace, even
/// with `RUST_BACKTRACE` set (as many Rust developers keep it).
#[test]
fn errors_are_one_message_without_a_backtrace() {
    let o = equiroute_with_env(
        &["check-config", "/nonexistent/equiroute.toml"],
        &[("RUST_BACKTRACE", "1"), ("RUST_LIB_BACKTRACE", "1")],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("Error: ") && err.contains("/nonexistent/equiroute.toml"),
        "{err}"
    );
    assert!(
        !err.contains("backtrace") && !err.contains(" at ") && err.lines().count() == 1,
        "{err}"
    );
}

#[test]
fn scenarios_and_policies_are_listed() {
    let o = equiroute(&["scenarios"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.lines().count() >= 14 && text.contains("ramp-ratelimit"));
    let o = equiroute(&["policies"]);
    let text = String::from_utf8_lossy(&o.stdout);
    let listed = text
        .lines()
        .filter(|l| l.split_whitespace().count() > 1 && !l.starts_with('`'))
        .count();
    assert!(
        o.status.success() && listed == 14 && text.contains("lqm-ts"),
        "{text}"
    );
    // One policy's parameters: dotted paths, defaults and meanings.
    let o = equiroute(&["policies", "lqm-ts"]);
    let text = String::from_utf8_lossy(&o.stdout);
    let alpha = text
        .lines()
        .find(|l| l.trim_start().starts_with("lqm.alpha_ucb "))
        .unwrap_or_else(|| panic!("no lqm.alpha_ucb line in\n{text}"));
    assert!(
        alpha.contains(" 0.2 ") && alpha.contains("exploration"),
        "{alpha}"
    );
    let o = equiroute(&["policies", "lqmx"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("lqmx") && err.contains("ts-deadline"),
        "{err}"
    );
}

/// Every `--set` example that `equiroute bench --help` prints runs (one once failed with
/// "`lqm` is not a table of `lqm`").
#[test]
fn the_set_examples_of_bench_help_run() {
    let o = equiroute(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    let examples: Vec<&str> = help
        .split("`--set ")
        .skip(1)
        .filter_map(|rest| rest.split('`').next())
        .collect();
    assert!(examples.len() >= 2, "{help}");
    let dir = temp_dir("help-set");
    for example in examples {
        let policy = example.split('.').next().unwrap();
        let o = equiroute(&[
            "bench",
            "--scenario",
            "near-ties",
            "--policies",
            policy,
            "--seeds",
            "1",
            "--rounds",
            "50",
            "--format",
            "json",
            "--out",
            dir.to_str().unwrap(),
            "--set",
            example,
        ]);
        assert!(
            o.status.success(),
            "--set {example}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_config_reports_every_problem_with_its_field() {
    let dir = temp_dir("check");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\napi_key_env = \"EQUIROUTE_TEST_UNSET_KEY\"\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 50, p95_ms = 10 } }\n",
    )
    .unwrap();
    let o = equiroute(&["check-config", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("interfaces.chat.providers[0].base_url"),
        "{err}"
    );
    assert!(
        err.contains("interfaces.chat.providers[1].sim.latency"),
        "{err}"
    );
    assert!(err.contains("2 problem(s)"), "{err}");
    let good = dir.join("good.toml");
    std::fs::write(&good, equiroute_gateway_default()).unwrap();
    let o = equiroute(&["check-config", good.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("ok, listening on 127.0.0.1:8080") && !out.contains("warning"),
        "{out}"
    );
    // A field the provider's kind does not read: a warning naming it, still a success.
    let odd = dir.join("odd.toml");
    let text = equiroute_gateway_default().replacen(
        "kind = \"sim\"",
        "kind = \"sim\"\nurl = \"http://x\"",
        1,
    );
    std::fs::write(&odd, text).unwrap();
    let o = equiroute(&["check-config", odd.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("warning:") && out.contains("providers[0].url`: ignored: a `sim` provider"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Five different mistakes, five problems in one run, each with its fix; no Rust type name.
#[test]
fn check_config_reports_five_mistakes_in_one_run_each_with_its_fix() {
    let dir = temp_dir("five");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("five.toml");
    std::fs::write(
        &bad,
        r#"[server]
listen = "gateway.local:8080"

[interfaces.chat]
kind = "chat"
deadlin_ms = 5000
max_attempts = "three"

[[interfaces.chat.providers]]
id = "a"
kind = "openia"
base_url = "http://127.0.0.1:9/v1"

[interfaces.search]
kind = "tool"

[interfaces.search.providers]
id = "s"
kind = "http"
url = "http://127.0.0.1:9/search"
"#,
    )
    .unwrap();
    let o = equiroute(&["check-config", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("5 problem(s)"), "{err}");
    for (field, fix) in [
        ("interfaces.chat.deadlin_ms", "did you mean `deadline_ms`?"),
        (
            "interfaces.chat.max_attempts",
            "expected a whole number, e.g. `max_attempts = 3`, got a string",
        ),
        (
            "interfaces.chat.providers[0].kind",
            "(did you mean `openai`?)",
        ),
        (
            "interfaces.search.providers",
            "double brackets: `[[interfaces.search.providers]]`",
        ),
        (
            "server.listen",
            "a host name is not allowed here, write an IP address and port, e.g. 127.0.0.1:8080",
        ),
    ] {
        assert!(
            err.lines()
                .any(|l| l.contains(&format!("`{field}`: ")) && l.contains(fix)),
            "{field}: {fix}\n{err}"
        );
    }
    for rust in ["struct ", "enum ", "RawInterface", "u32", "f64"] {
        assert!(!err.contains(rust), "no Rust type names ({rust}): {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_config_never_prints_a_key_pasted_where_its_variable_name_belongs() {
    let dir = temp_dir("check-pasted");
    std::fs::create_dir_all(&dir).unwrap();
    let key = "sk-proj-Pasted0123456789abcdefXYZ";
    let pasted = dir.join("pasted.toml");
    std::fs::write(
        &pasted,
        format!("[server]\napi_keys_env = [\"{key}\"]\n[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\napi_key_env = \"{key}\"\n"),
    )
    .unwrap();
    let o = equiroute(&["check-config", pasted.to_str().unwrap()]);
    assert!(!o.status.success());
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        !out.contains("Pasted0123") && !err.contains("Pasted0123"),
        "{out}{err}"
    );
    for field in [
        "server.api_keys_env[0]",
        "interfaces.chat.providers[0].api_key_env",
    ] {
        assert!(
            err.lines().any(|l| l.contains(field)
                && l.contains(
                    "looks like a secret value, not the name of an environment variable"
                )),
            "{field}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn equiroute_gateway_default() -> &'static str {
    include_str!("../../equiroute-gateway/src/config/default.toml")
}

#[test]
fn bench_set_changes_one_policy_parameter_and_names_a_bad_value() {
    let out = temp_dir("set");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--scenario",
            "llm-pool",
            "--policies",
            "lqm-ts",
            "--seeds",
            "1",
            "--format",
            "json",
            "--out",
        ];
        args.push(out.to_str().unwrap());
        args.extend_from_slice(extra);
        equiroute(&args)
    };
    let quality = |o: &std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["policies"]["lqm-ts"]["share"]["frontier"]
            .as_f64()
            .unwrap()
    };
    let renewal = quality(&run(&["--set", "lqm-ts.latency=renewal"]));
    let over = quality(&run(&[]));
    // Within its latency budget (the default) the best model is not discounted for being slow.
    assert!(over > renewal, "frontier share {over} vs {renewal}");
    let bad = run(&["--set", "lqm-ts.latency=sideways"]);
    assert!(!bad.status.success());
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(e.contains("sideways") && e.contains("over-budget"), "{e}");
}

/// The `check-config examples/gateway.toml` transcripts of `docs/configuration.md` are what the
/// binary prints: with every variable set (the summary), and with none (every problem).
#[test]
fn the_documented_check_config_transcripts_are_true() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let docs = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    // Each console block's runs of `$ equiroute check-config examples/gateway.toml`.
    let mut transcripts: Vec<Vec<String>> = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in docs.lines() {
        if line.starts_with("$ ") || line.starts_with("```") {
            if let Some(t) = current.take() {
                transcripts.push(t);
            }
            if line == "$ equiroute check-config examples/gateway.toml" {
                current = Some(Vec::new());
            }
        } else if let Some(t) = &mut current {
            t.push(line.to_owned());
        }
    }
    assert_eq!(
        transcripts.len(),
        2,
        "two documented runs on examples/gateway.toml"
    );
    let vars = [
        "EQUIROUTE_API_KEY",
        "OPENAI_API_KEY",
        "OTHER_API_KEY",
        "SEARCH_A_KEY",
        "SEARCH_B_KEY",
    ];
    for transcript in transcripts {
        let all_set = transcript.iter().any(|l| l.contains(": ok,"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_equiroute"));
        cmd.current_dir(&root)
            .args(["check-config", "examples/gateway.toml"]);
        for v in vars {
            if all_set {
                cmd.env(v, "placeholder");
            } else {
                cmd.env_remove(v);
            }
        }
        let o = cmd.output().unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let printed: Vec<&str> = printed.lines().collect();
        assert_eq!(printed, transcript, "docs/configuration.md is out of date");
        assert_eq!(o.status.success(), all_set);
    }
}
