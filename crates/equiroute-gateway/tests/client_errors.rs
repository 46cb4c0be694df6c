//! Every client mistake is answered with a 4xx and the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}` that the official SDKs parse (they retry
//! 5xx, so a 5xx for the caller's own mistake would be sent again and again): one table,
//! each row a request and the status, type, code and `param` it must get.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{mock, start, Reply};
use serde_json::json;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A gateway with a chat interface of two OpenAI providers without JSON mode or image input
/// (on one healthy mock), and an interface `private` that serves the tenant `acme` only.
async fn gateway(upstream: SocketAddr) -> common::Gateway {
    let provider = |iface: &str, id: &str, extra: &str| {
        format!(
            r#"
[[interfaces.{iface}.providers]]
id = "{id}"
kind = "openai"
model = "m"
base_url = "http://{upstream}/v1"
capabilities = {{ json_mode = false, vision = false, context_tokens = 8000 }}
{extra}
"#
        )
    };
    let cfg = format!(
        r#"
[server]
max_body_bytes = 65536
max_header_bytes = 131072

[interfaces.chat]
kind = "chat"
deadline_ms = 3000
{}{}
[interfaces.private]
kind = "chat"
deadline_ms = 3000
{}"#,
        provider("chat", "a", ""),
        provider("chat", "b", ""),
        provider("private", "p", "tenants = [\"acme\"]"),
    );
    start(&cfg, &[]).await
}

/// Sends `raw` as is (a request line and headers the client helper would not write) and
/// reads the answer to the connection's end.
async fn raw(addr: SocketAddr, raw: &[u8]) -> Reply {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// A chat request with `body` and the extra header lines `headers`, written by hand.
fn post(body: &serde_json::Value, headers: &str) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A chat request saying "hi", with the members of `extra`.
fn hi(extra: serde_json::Value) -> serde_json::Value {
    let mut body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    if let (Some(b), serde_json::Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    body
}

/// One row: what is sent, and the status, `code` and `param` it must get (`type` is
/// `invalid_request_error` for every row).
struct Case {
    what: &'static str,
    request: Vec<u8>,
    status: u16,
    code: &'static str,
    param: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    let image = json!({"model": "chat", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    ]}]});
    let private = json!({"model": "private", "messages": [{"role": "user", "content": "hi"}]});
    vec![
        Case {
            what: "max_tokens 4294967295 (beyond every provider's context window)",
            request: post(&hi(json!({"max_tokens": 4_294_967_295_u64})), ""),
            status: 400,
            code: "context_length_exceeded",
            param: Some("max_tokens"),
        },
        Case {
            what: "deadline header 1e-9 ms (too short for any attempt)",
            request: post(&hi(json!({})), "x-equiroute-deadline-ms: 1e-9\r\n"),
            status: 400,
            code: "invalid_deadline",
            param: Some("x-equiroute-deadline-ms"),
        },
        Case {
            what: "a tenant that no provider of the interface allows",
            request: post(&private, "x-equiroute-tenant: someone-else\r\n"),
            status: 403,
            code: "tenant_not_allowed",
            param: Some("x-equiroute-tenant"),
        },
        Case {
            what: "JSON mode where no provider declares it",
            request: post(&hi(json!({"response_format": {"type": "json_object"}})), ""),
            status: 400,
            code: "unsupported_parameter",
            param: Some("response_format"),
        },
        Case {
            what: "image input where no provider takes it",
            request: post(&image, ""),
            status: 400,
            code: "unsupported_parameter",
            param: Some("messages"),
        },
        Case {
            what: "a request target over 64 KiB (414)",
            request: format!(
                "GET /v1/models?{} HTTP/1.1\r\nhost: gw\r\n\r\n",
                "q".repeat(70_000)
            )
            .into_bytes(),
            status: 414,
            code: "uri_too_long",
            param: None,
        },
        Case {
            what: "headers over server.max_header_bytes (431)",
            request: format!(
                "GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-big: {}\r\n\r\n",
                "h".repeat(140_000)
            )
            .into_bytes(),
            status: 431,
            code: "request_header_fields_too_large",
            param: None,
        },
        Case {
            what: "a Content-Length that is not a number",
            request: b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: ten\r\n\r\n"
                .to_vec(),
            status: 400,
            code: "malformed_http_request",
            param: None,
        },
        Case {
            what: "two different Content-Lengths",
            request: b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}"
                .to_vec(),
            status: 400,
            code: "malformed_http_request",
            param: None,
        },
        Case {
            what: "a chunked body that grows past server.max_body_bytes (413)",
            request: format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
                70_000,
                " ".repeat(70_000)
            )
            .into_bytes(),
            status: 413,
            code: "request_too_large",
            param: None,
        },
        Case {
            what: "a body over server.max_body_bytes (413)",
            request: post(&hi(json!({"user": "u".repeat(70_000)})), ""),
            status: 413,
            code: "request_too_large",
            param: None,
        },
    ]
}

#[tokio::test]
async fn every_client_mistake_is_a_4xx_with_an_openai_error_body() {
    let upstream = mock("").await;
    let gw = gateway(upstream.addr).await;
    let mut wrong = Vec::new();
    for case in cases() {
        let reply = raw(gw.addr, &case.request).await;
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap_or_default();
        let error = &body["error"];
        let got = (
            reply.status,
            error["type"].as_str(),
            error["code"].as_str(),
            error["param"].as_str(),
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
        );
        let want = (
            case.status,
            Some("invalid_request_error"),
            Some(case.code),
            case.param,
            true,
        );
        if got != want {
            wrong.push(format!(
                "{}: got {got:?}, want {want:?}; body {}",
                case.what, reply.body
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
