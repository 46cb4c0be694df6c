//! The documentation's configuration examples are real: every TOML block of the README loads as
//! a gateway configuration, every `policy = …` example of `docs/configuration.md` builds its
//! policy, the mock-upstream profile example parses, and every other TOML block of
//! `docs/configuration.md` (providers of each kind, the Redis state) loads. A renamed or removed field fails here,
//! so the docs cannot drift from the code.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use equiroute_gateway::config::load;
use equiroute_mock::MockProfile;

/// The workspace root (this crate is `crates/equiroute-gateway`).
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The bodies of the fenced blocks of `lang` in a Markdown text.
fn blocks(markdown: &str, lang: &str) -> Vec<String> {
    let open = format!("```{lang}");
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match &mut current {
            None if line.trim_start() == open => current = Some(String::new()),
            Some(body) if line.trim_start().starts_with("```") => {
                out.push(std::mem::take(body));
                current = None;
            }
            Some(body) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    out
}

/// Any variable a documented configuration names is set (to a placeholder URL or key).
fn env(name: &str) -> Option<String> {
    let value = if name.contains("REDIS") {
        "redis://127.0.0.1:6379/0".to_owned()
    } else {
        format!("placeholder-for-{name}")
    };
    Some(value).filter(|_| !name.is_empty())
}

#[test]
fn every_toml_block_of_the_readme_is_a_valid_gateway_configuration() {
    let readme = read("README.md");
    let found = blocks(&readme, "toml");
    assert!(!found.is_empty(), "the README shows a configuration");
    for block in found {
        if let Err(e) = load(&block, "README.md", &env) {
            panic!("a README configuration does not load: {e}\n{block}");
        }
    }
}

#[test]
fn every_policy_example_of_the_configuration_docs_builds() {
    let docs = read("docs/configuration.md");
    let examples: Vec<String> = blocks(&docs, "toml")
        .iter()
        .flat_map(|b| b.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter(|l| l.starts_with("policy = "))
        .collect();
    assert!(
        examples.len() >= 3,
        "docs/configuration.md shows policy examples, found {examples:?}"
    );
    for policy in examples {
        // The providers the examples name (a priority order names two of them).
        let sim = "sim = { latency = { p50_ms = 100, p95_ms = 300 } }\n";
        let text = format!(
            "[interfaces.chat]\nkind = \"chat\"\n{policy}\n\
             [[interfaces.chat.providers]]\nid = \"openai-standard\"\nkind = \"sim\"\n{sim}\
             [[interfaces.chat.providers]]\nid = \"openai-flex\"\nkind = \"sim\"\n{sim}"
        );
        if let Err(e) = load(&text, "docs/configuration.md", &env) {
            panic!("the documented `{policy}` does not load: {e}");
        }
    }
}

#[test]
fn the_mock_profile_example_parses() {
    let docs = read("docs/configuration.md");
    let profiles: Vec<String> = blocks(&docs, "toml")
        .into_iter()
        .filter(|b| b.trim_start().starts_with("[chat]"))
        .collect();
    assert_eq!(profiles.len(), 1, "one mock-upstream profile example");
    if let Err(e) = MockProfile::from_toml(&profiles[0], "docs/configuration.md") {
        panic!("the documented mock profile does not parse: {e}");
    }
}

#[test]
fn the_block_reader_finds_blocks_and_only_them() {
    let md = "text\n```toml\na = 1\n```\n```sh\nls\n```\n```toml\nb = 2\nc = 3\n```\n";
    assert_eq!(blocks(md, "toml"), vec!["a = 1\n", "b = 2\nc = 3\n"]);
    assert_eq!(blocks(md, "sh"), vec!["ls\n"]);
}

/// The metric families in a Prometheus exposition: sample names, with a histogram's
/// `_bucket`, `_sum` and `_count` series folded into its family (named by its `# TYPE` line).
fn families(exposition: &str) -> std::collections::BTreeSet<String> {
    let histograms: Vec<&str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" histogram"))
        .collect();
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or(l))
        .map(|name| {
            histograms
                .iter()
                .find(|h| {
                    name.strip_prefix(**h)
                        .is_some_and(|rest| ["_bucket", "_sum", "_count"].contains(&rest))
                })
                .map_or(name, |h| *h)
                .to_owned()
        })
        .collect()
}

/// Every metric name written as a string literal in the crate's code (tests excluded): a
/// family added anywhere shows up here even if nothing below records it.
fn metric_names_in_source() -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for (_, code) in common::sources() {
        for (at, _) in code.match_indices("\"equiroute_") {
            let name: String = code[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            names.insert(name);
        }
    }
    names
}

/// The metric families `docs/configuration.md` documents: every `equiroute_…` name in
/// backticks in its `/metrics` section.
fn documented_metrics() -> std::collections::BTreeSet<String> {
    let docs = read("docs/configuration.md");
    let start = docs
        .find("### `GET /metrics`")
        .expect("docs/configuration.md has a /metrics section");
    let section = &docs[start + 3..];
    let section = &section[..section.find("\n#").unwrap_or(section.len())];
    section
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| code.starts_with("equiroute_"))
        .map(|code| code.split('{').next().unwrap_or(code).to_owned())
        .collect()
}

#[test]
fn the_documented_metrics_are_the_exposed_metrics() {
    use equiroute_gateway::server::state::AppState;
    // Shared state (never connected here) so that its metrics are rendered too.
    let text = "[state]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n\
        [interfaces.chat]\nkind = \"chat\"\n\
        shadow = \"least-latency\"\nrollout = { policy = \"round-robin\", percent = 5 }\n\
        [[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\n\
        sim = { latency = { p50_ms = 1, p95_ms = 2 } }\n";
    let cfg = load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
    let state = AppState::new(&cfg, 1).unwrap_or_else(|e| panic!("{e}"));
    // Every recorder once: counters appear once counted.
    let m = &state.metrics;
    m.request("chat", "ok");
    m.attempt("chat", "a", "ok");
    m.last_resort("chat");
    m.rejection_disputed("chat", "a");
    m.hedge("chat", "started");
    m.hedge_reason("chat", "priced");
    m.stream_continuation("chat", "prefix");
    m.breaker("chat", "a", "open");
    m.capacity_skip("chat", "a", "rpm");
    m.task_class_unlisted("chat");
    m.task_class_too_long("chat");
    m.slices_evicted("chat", 1);
    m.quality_shift("chat", "a", "down");
    m.feedback("accepted");
    m.snapshot("saved");
    m.decision_time(3.0);
    m.router_time(5.0);
    m.first_byte("chat", 12.0);
    m.feedback_delay("chat", 3.0);
    // The interface's series every request records, taken once by its runtime.
    let meters = &state.interface("chat").unwrap().meters;
    meters.fallback();
    meters.request_end(40.0, 0.002);
    meters.provider_latency(0, 40.0);
    meters.attempt(m, 0, "ok", 0.002);
    meters.provider_tokens(0, 12, 4);
    m.tls_handshake_failures("timeout").inc();
    m.tls_reloads(true).inc();
    let mut exposition = m.render();
    state
        .shared
        .as_ref()
        .expect("redis backend")
        .render_metrics(&mut exposition);
    // One live decision, finished, in the shadow's window: its value gauges appear.
    let iface = &state.interface("chat").unwrap();
    let features = iface.featurizer.featurize("a question");
    let ctx = equiroute_core::policies::RankContext::new(&iface.candidates, &[0], &features);
    let (_, routed) = equiroute_gateway::server::arms::rank(iface, &ctx, None, u64::MAX, 0)
        .unwrap_or_else(|_| panic!("poisoned"));
    equiroute_gateway::server::arms::finish(
        iface,
        "req-1",
        routed,
        equiroute_core::executor::RequestStatus::Succeeded { candidate: 0 },
        0.0,
    );
    equiroute_gateway::server::arms::render_metrics(&**state.interfaces(), &mut exposition);
    let exposed = families(&exposition);
    assert_eq!(
        exposed,
        metric_names_in_source(),
        "a metric family in the code is not recorded by this test: record it above"
    );
    let documented = documented_metrics();
    let undocumented: Vec<&String> = exposed.difference(&documented).collect();
    let not_exposed: Vec<&String> = documented.difference(&exposed).collect();
    assert!(
        undocumented.is_empty() && not_exposed.is_empty(),
        "exposed but not in docs/configuration.md's /metrics section: {undocumented:?}; \
         documented there but never exposed: {not_exposed:?}"
    );
}

#[test]
fn metric_families_fold_a_histograms_series_and_keep_counters() {
    let text = "a_total{x=\"1\"} 2\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\nh_other 3\n";
    let got: Vec<String> = families(text).into_iter().collect();
    assert_eq!(got, ["a_total", "h", "h_other"]);
}

#[test]
fn the_providers_example_loads_with_every_chat_kind() {
    let cfg = match load(
        &read("examples/providers.toml"),
        "examples/providers.toml",
        &env,
    ) {
        Ok(c) => c,
        Err(e) => panic!("examples/providers.toml does not load: {e}"),
    };
    assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    let kinds: Vec<String> = cfg.interfaces[0]
        .providers
        .iter()
        .map(|p| {
            format!("{:?}", p.upstream)
                .split([' ', '{'])
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    for kind in ["Anthropic", "Openai", "AzureOpenai", "Gemini", "Bedrock"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} in {kinds:?}");
    }
}

/// The interface a configuration fragment is completed with when it has none of its own.
const SIM_INTERFACE: &str = "[interfaces.chat]\nkind = \"chat\"\n\
    [[interfaces.chat.providers]]\nid = \"sim\"\nkind = \"sim\"\n\
    sim = { latency = { p50_ms = 100, p95_ms = 300 } }\n";

#[test]
fn every_toml_block_of_the_configuration_docs_is_checked() {
    let docs = read("docs/configuration.md");
    let found = blocks(&docs, "toml");
    let mut loaded = 0;
    for block in &found {
        let lines: Vec<&str> = block
            .lines()
            .map(|l| l.split(" #").next().unwrap_or(l).trim())
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let first = lines.first().copied().unwrap_or_default();
        let text = if lines.iter().all(|l| l.starts_with("policy = ")) || first == "[chat]" {
            // Policy lines and the mock profile: checked by the tests above.
            continue;
        } else if first == "[server.tls]" {
            // Its files are the reader's own: every field is known, and only the files
            // (absent here) are refused.
            let text = format!("{block}\n{SIM_INTERFACE}");
            let problems =
                equiroute_gateway::config::load_all(&text, "docs/configuration.md", &env)
                    .err()
                    .unwrap_or_default();
            assert!(
                !problems.is_empty()
                    && problems.iter().all(|p| p.field.starts_with("server.tls.")
                        && p.fix.contains("does not exist")),
                "the documented [server.tls] is refused for another reason than its absent files: {problems:?}"
            );
            loaded += 1;
            continue;
        } else if first.starts_with("[[interfaces.chat.providers]]") {
            format!("[interfaces.chat]\nkind = \"chat\"\n{block}")
        } else if ["[state]", "[server]", "[audit]", "[telemetry]"]
            .iter()
            .any(|t| first.starts_with(t))
        {
            format!("{block}\n{SIM_INTERFACE}")
        } else if first.starts_with("[interfaces.") {
            // A whole interface with its providers (e.g. the hedging example).
            block.clone()
        } else {
            panic!("a TOML block of docs/configuration.md that no test checks; add its kind here:\n{block}");
        };
        if let Err(e) = load(&text, "docs/configuration.md", &env) {
            panic!("a documented configuration does not load: {e}\n{block}");
        }
        loaded += 1;
    }
    assert!(
        loaded >= 4,
        "the provider kinds and the Redis state are shown ({loaded} loaded)"
    );
}
