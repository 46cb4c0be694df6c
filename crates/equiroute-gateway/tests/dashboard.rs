//! The dashboard's routes without a browser: the admin keys guard both (as a bearer key or as
//! the password of HTTP Basic, which a browser is asked for), and the data route reports the
//! requests just routed, the leader with its reason, and the decisions while watched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{http, start};

const CONFIG: &str = r#"
[server]
api_keys_env = ["GW_K"]
admin_keys_env = ["GW_ADMIN"]

[interfaces.chat]
kind = "chat"
policy = { name = "ts-deadline" }
deadline_ms = 2000

[[interfaces.chat.providers]]
id = "quick"
kind = "sim"
sim = { latency = { p50_ms = 1, p95_ms = 2 } }

[[interfaces.chat.providers]]
id = "steady"
kind = "sim"
sim = { latency = { p50_ms = 3, p95_ms = 6 } }
"#;

/// `user:password` in HTTP Basic form (base64 of the ASCII text).
fn basic(user_pass: &str) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::from("Basic ");
    for chunk in user_pass.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn the_dashboard_takes_the_admin_key_as_bearer_or_basic_and_reports_the_traffic() {
    let gw = start(CONFIG, &[("GW_K", "user-key"), ("GW_ADMIN", "admin-key")]).await;
    // Not open, not for the gateway key; the browser is asked for the key.
    for auth in [
        None,
        Some("Bearer user-key".to_owned()),
        Some(basic("me:user-key")),
    ] {
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let r = http(gw.addr, "GET", "/dashboard", &headers, "").await;
        assert_eq!(r.status, 401, "{auth:?}");
        assert!(r
            .header("www-authenticate")
            .unwrap()
            .starts_with("Basic realm="));
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.admin_keys_env"));
    }
    let page = http(
        gw.addr,
        "GET",
        "/dashboard",
        &[("authorization", &basic("anyone:admin-key"))],
        "",
    )
    .await;
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    assert!(
        page.body.contains("<svg") || page.body.contains("data-chart"),
        "the page draws charts"
    );
    assert!(
        !page.body.contains("http://") && !page.body.contains("https://"),
        "nothing fetched from elsewhere"
    );

    let data = |auth: &'static str| async move {
        http(
            gw.addr,
            "GET",
            "/dashboard/data",
            &[("authorization", auth)],
            "",
        )
        .await
    };
    // A first poll marks the dashboard as watched: the decisions after it are kept.
    assert_eq!(data("Bearer admin-key").await.status, 200);
    for _ in 0..5 {
        let r = http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[("authorization", "Bearer user-key")],
            r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let v = data("Bearer admin-key").await.json();
    let chat = &v["interfaces"][0];
    assert_eq!(chat["name"], "chat");
    let requests: u64 = chat["series"]["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .sum();
    assert_eq!(requests, 5);
    let first: u64 = ["quick", "steady"]
        .iter()
        .flat_map(|p| {
            chat["series"]["providers"][p]["first"]
                .as_array()
                .unwrap()
                .clone()
        })
        .map(|r| r.as_u64().unwrap())
        .sum();
    assert_eq!(first, 5, "each request has one first choice");
    assert_eq!(chat["decisions"].as_array().unwrap().len(), 5);
    assert_eq!(chat["decisions"][0]["outcome"], "ok");
    assert_eq!(
        chat["candidates"].as_array().unwrap().len(),
        2,
        "the state route's summary"
    );
    let leader = chat["leader"]["id"].as_str().unwrap();
    assert!(["quick", "steady"].contains(&leader));
    assert!(
        chat["leader"]["why"].as_str().unwrap().starts_with(leader),
        "{}",
        chat["leader"]
    );
}

#[tokio::test]
async fn the_operations_view_counts_per_configured_key_and_tenant_and_refuses_an_unknown_horizon() {
    let config = r#"
[server]
admin_keys_env = ["GW_ADMIN"]

[[server.keys]]
env = "GW_A"
name = "team-a"
tenant = "acme"

[[server.keys]]
env = "GW_B"
name = "team-b"

[interfaces.chat]
kind = "chat"
policy = { name = "ts-deadline" }

[[interfaces.chat.providers]]
id = "quick"
kind = "sim"
sim = { latency = { p50_ms = 1, p95_ms = 2 } }
price = { per_call = 0.001 }
"#;
    let gw = start(
        config,
        &[
            ("GW_A", "key-a"),
            ("GW_B", "key-b"),
            ("GW_ADMIN", "admin-key"),
        ],
    )
    .await;
    let ask = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#;
    for (key, times, status) in [("key-a", 3, 200), ("key-b", 2, 200), ("key-x", 2, 401)] {
        for _ in 0..times {
            let auth = format!("Bearer {key}");
            let r = http(
                gw.addr,
                "POST",
                "/v1/chat/completions",
                &[("authorization", &auth)],
                ask,
            )
            .await;
            assert_eq!(r.status, status, "{key}");
        }
    }
    let admin = [("authorization", "Bearer admin-key")];
    let r = http(gw.addr, "GET", "/dashboard/ops?horizon=1h", &admin, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["horizon_ms"], 3_600_000);
    assert_eq!(
        v["error_classes"],
        serde_json::json!([
            "429",
            "5xx",
            "timeout",
            "connection",
            "4xx",
            "stream_broken",
            "content_filter"
        ])
    );
    let chat = &v["interfaces"][0];
    assert_eq!(chat["bin_ms"], 60_000);
    assert_eq!(chat["requests"].as_array().unwrap().len(), 60);
    assert_eq!(
        chat["total"]["requests"], 5,
        "an unknown key's requests never ran"
    );
    let quick = &chat["providers"]["quick"]["total"];
    assert_eq!(quick["answered"], 5);
    assert!(
        quick["latency_ms"]["p99"].as_f64().unwrap() > 0.0,
        "{quick}"
    );
    assert!((quick["cost_usd"].as_f64().unwrap() - 0.005).abs() < 1e-12);
    // One row per configured client key (never the admin key), with its tenant.
    let keys = chat["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0]["key"], "team-a");
    assert_eq!(keys[0]["tenant"], "acme");
    assert_eq!(keys[0]["requests"], 3);
    assert_eq!(keys[1]["key"], "team-b");
    assert_eq!(keys[1]["requests"], 2);
    assert_eq!(chat["last_day"]["keys"][1]["requests"], 2);
    assert!(!r.body.contains("key-a"), "labels, never keys");

    let bad = http(gw.addr, "GET", "/dashboard/ops?horizon=7d", &admin, "").await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "horizon");
    let open = http(gw.addr, "GET", "/dashboard/ops", &[], "").await;
    assert_eq!(open.status, 401, "behind the admin keys");
}

#[tokio::test]
async fn the_operations_view_tells_a_content_filter_refusal_from_other_rejections() {
    let filtering = common::mock("[models.a]\nfault = \"content_filter\"\n").await;
    let config = format!(
        "[interfaces.chat]\nkind = \"chat\"\n\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\nbase_url = \"http://{}/v1\"\n",
        filtering.addr
    );
    let gw = start(&config, &[]).await;
    let ask = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], ask).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "content_filter");
    let v = http(gw.addr, "GET", "/dashboard/ops", &[], "").await.json();
    let errors = &v["interfaces"][0]["providers"]["a"]["total"]["errors"];
    assert_eq!(errors["content_filter"], 1, "{errors}");
    assert_eq!(errors["4xx"], 0, "{errors}");
}
