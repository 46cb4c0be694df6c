//! The dashboard in a real headless Chromium, driven through chromedriver's `WebDriver` protocol:
//! `equiroute serve` routes traffic between two `equiroute mock-upstream` processes, the page
//! renders its charts and tables, then the preferred provider goes down and the page shows its
//! traffic share falling and its breaker open, without a console error. Screenshots go to
//! `target/tmp/dashboard-*.png`.
//!
//! Skipped, with a message, where `chromium` or `chromedriver` is missing (`.ci/run` installs
//! the Debian packages `chromium` and `chromium-driver`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_equiroute")
}

/// The first of `names` found on PATH (or given as an absolute path).
fn find(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| {
        let out = Command::new("sh")
            .args(["-c", &format!("command -v {n}")])
            .output()
            .ok()?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !path.is_empty()).then_some(path)
    })
}

/// Children killed when the test ends, even when it fails.
#[derive(Default)]
struct Procs(Vec<(&'static str, Child)>);

impl Procs {
    fn kill(&mut self, name: &str) {
        if let Some(at) = self.0.iter().position(|(n, _)| *n == name) {
            let (_, mut child) = self.0.remove(at);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts the binary with `args` and returns it with the address it prints after `http://`.
// Every child goes into `Procs`, which kills and waits for it.
#[allow(clippy::zombie_processes)]
fn start(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "{args:?} did not start"
        );
        if let Some(at) = line.find("http://") {
            let addr = line[at + 7..].split_whitespace().next().unwrap().to_owned();
            // Keep draining stdout so that the child never blocks on a full pipe.
            std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
            return (child, addr);
        }
    }
}

/// One HTTP/1.1 exchange (`connection: close`): the status and the body.
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read to the end of the body by its length: chromedriver keeps the connection open.
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() >= n) {
                break;
            }
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}

/// A `WebDriver` session on chromedriver at `addr`.
struct Browser {
    addr: String,
    session: String,
}

impl Browser {
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let (status, text) = http(
            &self.addr,
            method,
            &format!("/session/{}{path}", self.session),
            body,
        );
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert_eq!(status, 200, "WebDriver {method} {path}: {text}");
        v["value"].clone()
    }

    fn script(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(&json!({"script": script, "args": []})),
        )
    }

    /// Waits (polling the page, `limit` at most) until `script` returns true.
    fn wait_for(&self, what: &str, script: &str, limit: Duration) {
        let until = Instant::now() + limit;
        while self.script(script) != json!(true) {
            assert!(
                Instant::now() < until,
                "the page did not show {what} within {limit:?}: {}",
                self.script(PROBE)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn screenshot(&self, name: &str) -> std::path::PathBuf {
        let b64 = self.call("GET", "/screenshot", None);
        let png = equiroute_gateway::server::dashboard::decode_base64(b64.as_str().unwrap())
            .expect("a base64 screenshot");
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        std::fs::write(&path, png).unwrap();
        path
    }
}

/// What the page shows, read from its DOM.
const PROBE: &str = r#"
const sec = document.querySelector('section[data-interface="chat"]');
const rows = {};
for (const tr of document.querySelectorAll('table.providers tr[data-provider]')) {
  rows[tr.dataset.provider] = { share: Number(tr.dataset.share), breaker: tr.querySelector('.pill') ? tr.querySelector('.pill').className : null };
}
return {
  updates: window.equirouteDashboard ? window.equirouteDashboard.updates : 0,
  errors: window.equirouteDashboard ? window.equirouteDashboard.errors : [],
  charts: [...document.querySelectorAll('svg[data-chart]')].map(s => s.dataset.chart),
  share_paths: [...document.querySelectorAll('svg[data-chart="share"] path[data-provider]')].map(p => [p.dataset.provider, (p.getAttribute('d').match(/[ML]/g) || []).length]),
  rows,
  leader: sec && sec.querySelector('.leader') ? sec.querySelector('.leader').textContent : null,
  decisions: document.querySelectorAll('tr[data-decision]').length,
  fallbacks: document.querySelectorAll('tr[data-fallback]').length,
  status: document.getElementById('status').textContent,
  config: document.getElementById('config').textContent,
};
"#;

/// Requests (and a quality score for each answer) from two threads until `stop`.
fn traffic(gateway: &str, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..2)
        .map(|_| {
            let (gateway, stop) = (gateway.to_owned(), stop.clone());
            std::thread::spawn(move || {
                let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]});
                while !stop.load(Ordering::Relaxed) {
                    // The gateway stops first when the test fails: end quietly then.
                    let Ok(mut s) = std::net::TcpStream::connect(&gateway) else {
                        return;
                    };
                    let body = ask.to_string();
                    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
                    let mut reply = String::new();
                    let _ = s.read_to_string(&mut reply);
                    let header = |name: &str| {
                        reply.lines().find_map(|l| {
                            l.strip_prefix(name).map(|v| v.trim().to_owned())
                        })
                    };
                    if let (Some(id), Some(provider)) = (
                        header("x-equiroute-request-id:"),
                        header("x-equiroute-provider:"),
                    ) {
                        let quality = if provider == "fast" { 0.9 } else { 0.6 };
                        http(
                            &gateway,
                            "POST",
                            "/v1/feedback",
                            Some(&json!({"request_id": id, "quality": quality})),
                        );
                    }
                }
            })
        })
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `equiroute serve` (kept in `procs`) routing interface `chat` with `lqm-ts` between two
/// OpenAI-style `providers` (`(id, address, price per call)`), with `(deadline, breaker open
/// period)` in milliseconds (the breaker opens after 3 failures in a row). Returns its address.
fn serve_two(
    procs: &mut Procs,
    dir: &std::path::Path,
    (deadline_ms, open_ms): (u32, u32),
    providers: [(&str, &str, f64); 2],
) -> String {
    let mut text = format!(
        "[interfaces.chat]\nkind = \"chat\"\npolicy = {{ name = \"lqm-ts\" }}\ndeadline_ms = {deadline_ms}\nbreaker = {{ consecutive_failures = 3, open_ms = {open_ms} }}\n"
    );
    for (id, addr, price) in providers {
        use std::fmt::Write as _;
        let _ = write!(
            text,
            "\n[[interfaces.chat.providers]]\nid = \"{id}\"\nkind = \"openai\"\nmodel = \"{id}-model\"\nbase_url = \"http://{addr}/v1\"\nprice = {{ per_call = {price} }}\n"
        );
    }
    let config = dir.join("gateway.toml");
    std::fs::write(&config, text).unwrap();
    let (gw, gateway) = start(&[
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    procs.0.push(("serve", gw));
    gateway
}

/// A headless Chromium session on a chromedriver started on a free port (killed with `procs`).
fn session(procs: &mut Procs, chromium: &str, driver: &str) -> Browser {
    let port = free_port();
    let chromedriver = Command::new(driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    procs.0.push(("chromedriver", chromedriver));
    let driver_addr = format!("127.0.0.1:{port}");
    let until = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&driver_addr).is_err() {
        assert!(Instant::now() < until, "chromedriver did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, text) = http(
        &driver_addr,
        "POST",
        "/session",
        Some(&json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1500"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}})),
    );
    assert_eq!(status, 200, "chromedriver session: {text}");
    let session: Value = serde_json::from_str(&text).unwrap();
    Browser {
        addr: driver_addr,
        session: session["value"]["sessionId"].as_str().unwrap().to_owned(),
    }
}

/// The browser's console errors and the page's uncaught exceptions: none expected.
fn assert_no_console_errors(browser: &Browser) {
    let logs = browser.call("POST", "/se/log", Some(&json!({"type": "browser"})));
    let severe: Vec<&Value> = logs
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["level"] == "SEVERE")
        .collect();
    assert!(severe.is_empty(), "console errors: {severe:?}");
    assert_eq!(
        browser.script("return window.equirouteDashboard.errors;"),
        json!([])
    );
}

#[test]
#[allow(clippy::too_many_lines)] // one scenario, read top to bottom
fn the_dashboard_renders_in_chromium_and_shows_a_failing_providers_share_fall() {
    let (Some(chromium), Some(driver)) = (
        find(&["chromium", "chromium-browser", "google-chrome"]),
        find(&["chromedriver"]),
    ) else {
        eprintln!("SKIPPED the dashboard browser test: chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver)");
        return;
    };
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut procs = Procs::default();
    let began = Instant::now();
    let mut mock = |name: &'static str, p50: u32| {
        let profile = format!("latency = {{ p50_ms = {p50}, p95_ms = {} }}", 2 * p50);
        mock_at(&mut procs, &dir, name, "127.0.0.1:0", &profile)
    };
    let (fast, slow) = (mock("fast", 10), mock("slow", 60));
    let gateway = serve_two(
        &mut procs,
        &dir,
        (1000, 60_000),
        [("fast", &fast, 0.002), ("slow", &slow, 0.001)],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let drivers = traffic(&gateway, &stop);

    let browser = session(&mut procs, &chromium, &driver);

    eprintln!("browser session open after {:?}", began.elapsed());
    browser.call(
        "POST",
        "/url",
        Some(&json!({"url": format!("http://{gateway}/dashboard")})),
    );
    browser.wait_for(
        "its charts",
        "return !!window.equirouteDashboard && window.equirouteDashboard.updates >= 2 && document.querySelectorAll('svg[data-chart] path[data-provider]').length >= 6",
        Duration::from_secs(60),
    );
    // The preferred (faster, better-scored) provider takes most of the traffic.
    browser.wait_for(
        "`fast` leading",
        r#"const r = document.querySelector('tr[data-provider="fast"]'); return !!r && Number(r.dataset.share) > 0.5 && document.querySelectorAll('tr[data-decision]').length > 0;"#,
        Duration::from_secs(60),
    );
    eprintln!("page drawn, `fast` leading after {:?}", began.elapsed());
    let before = browser.script(PROBE);
    assert_eq!(
        before["charts"],
        json!([
            "volume",
            "latency_quantiles",
            "errors",
            "quality",
            "share",
            "failures",
            "latency",
            "cost"
        ]),
        "{before}"
    );
    for (provider, d) in before["share_paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].clone(), p[1].as_u64().unwrap()))
    {
        // An area over at least two seconds: two points along its top and two along its base
        // (the seconds before the gateway started are a gap, so a young gateway's is short).
        assert!(d >= 4, "the share area of {provider} is drawn: {before}");
    }
    assert!(
        before["leader"].as_str().unwrap().contains("leads"),
        "a one-line explanation of the leader: {before}"
    );
    assert!(
        before["rows"]["fast"]["breaker"]
            .as_str()
            .unwrap()
            .contains("closed"),
        "{before}"
    );
    assert!(
        before["config"]
            .as_str()
            .unwrap()
            .starts_with("configuration version 1, loaded at "),
        "the header shows the configuration's version: {before}"
    );
    let shot = browser.screenshot("dashboard-before.png");

    // `fast` goes down: its share falls and its breaker opens, on the page.
    procs.kill("fast");
    browser.wait_for(
        "`fast`'s share falling below 10% with its breaker open",
        r#"const r = document.querySelector('tr[data-provider="fast"]'); return !!r && Number(r.dataset.share) < 0.1 && r.querySelector('.pill.open') !== null && document.querySelectorAll('tr[data-fallback]').length > 0;"#,
        Duration::from_secs(60),
    );
    eprintln!("`fast`'s fall shown after {:?}", began.elapsed());
    let after = browser.script(PROBE);
    assert!(
        after["rows"]["slow"]["share"].as_f64().unwrap() > 0.9,
        "{after}"
    );
    assert!(
        after["leader"]
            .as_str()
            .unwrap()
            .starts_with("Why slow leads"),
        "{after}"
    );
    let shot_after = browser.screenshot("dashboard-after.png");
    stop.store(true, Ordering::Relaxed);

    // No console error and no uncaught exception in the page.
    assert_no_console_errors(&browser);
    assert_eq!(after["errors"], json!([]), "{after}");
    let _ = http(
        &browser.addr,
        "DELETE",
        &format!("/session/{}", browser.session),
        None,
    );
    for d in drivers {
        d.join().unwrap();
    }
    eprintln!(
        "dashboard screenshots: {} and {}",
        shot.display(),
        shot_after.display()
    );
}

/// A mock upstream called `name` listening on `listen` (`127.0.0.1:0`: a free port) with the
/// `[chat]` profile `profile`, kept in `procs`; returns its address.
fn mock_at(
    procs: &mut Procs,
    dir: &std::path::Path,
    name: &'static str,
    listen: &str,
    profile: &str,
) -> String {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, format!("[chat]\n{profile}\n")).unwrap();
    let (child, addr) = start(&[
        "mock-upstream",
        "--listen",
        listen,
        "--profile",
        path.to_str().unwrap(),
    ]);
    procs.0.push((name, child));
    addr
}

/// What the operations view shows, read from its DOM.
const OPS_PROBE: &str = r#"
const ops = document.querySelector('.ops[data-ops="chat"]');
const row = (id) => {
  const r = document.querySelector(`tr[data-ops-provider="${id}"]`);
  if (!r) return null;
  const classes = {};
  for (const td of r.querySelectorAll('td[data-error-class]')) classes[td.dataset.errorClass] = Number(td.textContent);
  return { attempts: Number(r.dataset.attempts), errors: Number(r.dataset.errors), classes, quantiles: r.querySelector('[data-quantiles]').textContent };
};
const clipped = [...document.querySelectorAll('svg[data-chart] text')].filter((t) => t.getBBox().x < 0).map((t) => t.textContent);
return {
  horizon: ops ? ops.dataset.horizon : null,
  summary: ops ? ops.querySelector('[data-ops-summary]').textContent : null,
  quantiles: ops ? ops.querySelector('[data-latency-quantiles]').textContent : null,
  volume: [...document.querySelectorAll('svg[data-chart="volume"] path[data-provider]')].map((p) => [p.dataset.provider, p.getAttribute('d').length]),
  latency_lines: [...document.querySelectorAll('svg[data-chart="latency_quantiles"] path[data-provider]')].map((p) => p.getAttribute('d').length),
  flaky: row('flaky'),
  steady: row('steady'),
  spend_hour: (document.querySelector('tr[data-spend="all"] [data-spend-hour]') || {}).textContent,
  spend_day: (document.querySelector('tr[data-spend="all"] [data-spend-day]') || {}).textContent,
  marks: [...document.querySelectorAll('svg[data-chart] line[data-mark]')].map((l) => [l.dataset.mark, l.dataset.markProvider]),
  mark_rows: document.querySelectorAll('tr[data-mark-row]').length,
  clipped,
  cost_axis: [...document.querySelectorAll('svg[data-chart="cost"] text')].map((t) => t.textContent),
};
"#;

/// Saves the page as a PNG where `EQUIROUTE_SCREENSHOT` says (relative to the workspace).
fn keep_screenshot(taken: &std::path::Path) {
    let Some(to) = std::env::var_os("EQUIROUTE_SCREENSHOT") else {
        return;
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let to = root.join(to);
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::copy(taken, &to).unwrap();
    eprintln!("screenshot kept at {}", to.display());
}

/// The `[chat]` profile of a healthy provider.
const HEALTHY: &str = "latency = { p50_ms = 15, p95_ms = 40 }";
/// Degraded: slower, and every call refused (503 or 429).
const DEGRADED: &str = "latency = { p50_ms = 40, p95_ms = 90 }\nerror_503 = 0.6\nerror_429 = 0.4";

#[test]
#[allow(clippy::too_many_lines)] // one scenario, read top to bottom
fn the_operations_view_shows_a_provider_degrading_and_recovering() {
    let (Some(chromium), Some(driver)) = (
        find(&["chromium", "chromium-browser", "google-chrome"]),
        find(&["chromedriver"]),
    ) else {
        eprintln!("SKIPPED the dashboard operations browser test: chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver)");
        return;
    };
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dashboard-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut procs = Procs::default();
    let began = Instant::now();
    let flaky = mock_at(&mut procs, &dir, "flaky", "127.0.0.1:0", HEALTHY);
    let steady = mock_at(
        &mut procs,
        &dir,
        "steady",
        "127.0.0.1:0",
        "latency = { p50_ms = 200, p95_ms = 400 }",
    );
    let gateway = serve_two(
        &mut procs,
        &dir,
        (3000, 3000),
        [("flaky", &flaky, 0.001), ("steady", &steady, 0.002)],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let drivers = traffic(&gateway, &stop);
    let browser = session(&mut procs, &chromium, &driver);
    browser.call(
        "POST",
        "/url",
        Some(&json!({"url": format!("http://{gateway}/dashboard")})),
    );

    // 1. Healthy: volume, latency quantiles and spend are drawn; `flaky` (faster, cheaper)
    //    takes most requests.
    browser.wait_for(
        "the operations view with traffic",
        r#"const r = document.querySelector('tr[data-ops-provider="flaky"]'); const s = document.querySelector('tr[data-ops-provider="steady"]'); const f = document.querySelector('tr[data-provider="flaky"]');
           return !!r && !!s && Number(r.dataset.attempts) + Number(s.dataset.attempts) >= 40 && !!f && Number(f.dataset.share) > 0.5;"#,
        Duration::from_secs(60),
    );
    eprintln!("operations view drawn after {:?}", began.elapsed());

    // 2. `flaky` degrades: slower, and 503s and 429s; its breaker opens.
    procs.kill("flaky");
    mock_at(&mut procs, &dir, "flaky", &flaky, DEGRADED);
    browser.wait_for(
        "`flaky`'s 5xx and 429 errors and its breaker opening marked",
        r#"const r = document.querySelector('tr[data-ops-provider="flaky"]'); if (!r) return false;
           const c = (k) => Number(r.querySelector(`td[data-error-class="${k}"]`).textContent);
           return c('5xx') > 0 && c('429') > 0 && !!document.querySelector('svg[data-chart="errors"] line[data-mark="breaker_open"][data-mark-provider="flaky"]');"#,
        Duration::from_secs(60),
    );
    eprintln!("degradation shown after {:?}", began.elapsed());

    // 3. `flaky` recovers: the breaker's test requests pass and it closes, marked too.
    procs.kill("flaky");
    mock_at(&mut procs, &dir, "flaky", &flaky, HEALTHY);
    browser.wait_for(
        "`flaky`'s breaker closing marked",
        r#"return !!document.querySelector('svg[data-chart="volume"] line[data-mark="breaker_closed"][data-mark-provider="flaky"]');"#,
        Duration::from_secs(60),
    );
    eprintln!("recovery shown after {:?}", began.elapsed());
    let seen = browser.script(OPS_PROBE);
    assert_eq!(seen["horizon"], "5 min", "{seen}");
    for (provider, d) in seen["volume"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].clone(), p[1].as_u64().unwrap()))
    {
        assert!(d > 100, "the volume of {provider} is drawn: {seen}");
    }
    assert_eq!(seen["latency_lines"].as_array().unwrap().len(), 3, "{seen}");
    let quantiles = seen["quantiles"].as_str().unwrap();
    assert_eq!(
        quantiles.matches(" ms").count() + quantiles.matches(" s").count(),
        3,
        "p50 · p95 · p99 end to end: {seen}"
    );
    let flaky_row = &seen["flaky"];
    assert!(flaky_row["errors"].as_u64().unwrap() > 0, "{seen}");
    assert_eq!(seen["steady"]["classes"]["5xx"], 0, "{seen}");
    let spend = seen["spend_hour"].as_str().unwrap();
    assert!(spend.starts_with('$') && spend != "$0", "{seen}");
    assert!(seen["mark_rows"].as_u64().unwrap() >= 2, "{seen}");
    assert_eq!(
        seen["clipped"],
        json!([]),
        "axis labels inside the charts: {seen}"
    );
    for label in seen["cost_axis"].as_array().unwrap().iter().take(5) {
        let label = label.as_str().unwrap();
        assert!(
            label.starts_with('$') && label.len() <= 8,
            "a short cost label: {label}"
        );
    }
    let shot = browser.screenshot("dashboard-ops.png");
    keep_screenshot(&shot);

    // The longer horizons read the minute ring.
    browser.script(
        r#"document.querySelector('#horizon button[data-horizon="1h"]').click(); return true;"#,
    );
    browser.wait_for(
        "the 1 h horizon",
        r#"const o = document.querySelector('.ops[data-ops="chat"]'); return !!o && o.dataset.horizon === "1 h" && !!document.querySelector('svg[data-chart="volume"] line[data-mark="breaker_open"]');"#,
        Duration::from_secs(20),
    );
    let hour = browser.script(OPS_PROBE);
    assert!(hour["flaky"]["errors"].as_u64().unwrap() > 0, "{hour}");
    stop.store(true, Ordering::Relaxed);
    assert_no_console_errors(&browser);
    let _ = http(
        &browser.addr,
        "DELETE",
        &format!("/session/{}", browser.session),
        None,
    );
    for d in drivers {
        d.join().unwrap();
    }
    eprintln!("operations screenshot: {}", shot.display());
}
