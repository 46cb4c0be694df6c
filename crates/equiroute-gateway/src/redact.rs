//! The one redaction step: every text that came from an upstream (an error body's message, a
//! transport error, a header value, a stream's error) becomes a [`Redacted`] before anything
//! can show it to a client, write it to a log line, a span or the audit log.
//!
//! A [`Redactor`] is built once, when the gateway starts, from every secret of the loaded
//! configuration (`GatewayConfig::secret_values` in `config`: the providers' keys, the AWS
//! credentials, the gateway's and the admin keys, the judge's key, the Redis URL) and knows
//! the common credential shapes besides: `Bearer …`, `sk-…` (OpenAI's
//! `sk-proj-…`, Anthropic's `sk-ant-…`), AWS key ids (`AKIA…`, `ASIA…`), Google API keys
//! (`AIza…`), the values of `authorization`, `x-api-key`, `api-key`, `x-goog-api-key` and
//! `x-amz-security-token` headers (as `name: value`, `name=value` or JSON), `key=` and
//! `token=` query parameters, and the password of a URL (`scheme://user:password@`). A match
//! becomes `<redacted>`; what names it (`x-api-key: `, `?key=`) stays, so a reader can tell
//! what was cut.
//!
//! Only failures pay: a successful attempt carries no text, so nothing is scanned or
//! allocated on the success path. The text kept is also cut to [`UPSTREAM_TEXT_MAX_CHARS`]
//! (after redaction, so no part of a secret survives the cut).

use regex::Regex;
use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::LazyLock;

/// What a secret or a credential is replaced with.
pub const MARK: &str = "<redacted>";

/// The most characters of an upstream's text kept (a provider may answer an error with a
/// 64 MiB page): beyond that it is cut, with its length.
pub const UPSTREAM_TEXT_MAX_CHARS: usize = 1024;

/// The credential shapes, one alternation. Groups named `keep*` hold what names the secret
/// (a header's name and separator, a scheme, a query parameter): they are kept.
const SHAPES: &str = concat!(
    // A header or JSON member that carries a credential: the whole value, scheme included.
    r#"(?P<keep_header>\b(?i:proxy-authorization|authorization|x-goog-api-key|x-api-key|api-key|api_key|apikey|x-amz-security-token)\b["']?\s*[:=]\s*["']?)(?:(?i:bearer|basic)\s+)?[^\s"',;&}]+"#,
    // A bearer credential anywhere else.
    r"|(?P<keep_scheme>\b(?i:bearer)\s+)[A-Za-z0-9._~+/=-]+",
    // A key in a URL's query (Gemini's `?key=`).
    r"|(?P<keep_query>[?&](?i:key|api_key|api-key|apikey|access_token|token|x-goog-api-key)=)[^&\s#]+",
    // The password of a URL (`redis://:pw@host`, `https://user:pw@host`).
    r"|(?P<keep_url>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@",
    // OpenAI's and Anthropic's key shapes (`sk-…`, `sk-proj-…`, `sk-ant-…`).
    r"|\bsk-[A-Za-z0-9_-]{8,}",
    // AWS access key ids (long-term `AKIA…`, temporary `ASIA…`).
    r"|\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",
    // Google API keys (Gemini's).
    r"|\bAIza[A-Za-z0-9_-]{30,}",
);

/// The compiled shapes; `None` only if the pattern above did not compile, which the unit tests
/// rule out (every text is then withheld whole, never shown unredacted).
static SHAPE_PATTERN: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(SHAPES).ok());

/// Text that came from an upstream with every secret cut out, or the gateway's own fixed
/// words. The only ways to make one are [`Redactor::redact`] and [`Redacted::fixed`], so a
/// text that reaches a client answer, a log line or a span through this type was redacted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Redacted(Cow<'static, str>);

impl Redacted {
    /// The gateway's own words (a literal in the code: nothing of an upstream's).
    #[must_use]
    pub const fn fixed(text: &'static str) -> Redacted {
        Redacted(Cow::Borrowed(text))
    }

    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The configured secrets and the credential shapes: see the module doc.
pub struct Redactor {
    /// Each secret's value (and its URL-encoded form when that differs), longest first so
    /// that a secret containing another is cut whole.
    secrets: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} secret forms)", self.secrets.len())
    }
}

impl Redactor {
    /// A redactor of `secrets` (empty values are skipped) and of the credential shapes.
    #[must_use]
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Redactor {
        let mut forms: Vec<String> = Vec::new();
        for s in secrets.into_iter().filter(|s| !s.is_empty()) {
            let encoded = url_encoded(s);
            if encoded != s {
                forms.push(encoded);
            }
            forms.push(s.to_owned());
        }
        forms.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        forms.dedup();
        Redactor { secrets: forms }
    }

    /// A redactor of the credential shapes only (no configured secret).
    #[must_use]
    pub fn shapes_only() -> Redactor {
        Redactor::new([])
    }

    /// `text` with every configured secret and every credential shape replaced by
    /// [`MARK`], cut to [`UPSTREAM_TEXT_MAX_CHARS`] characters.
    #[must_use]
    pub fn redact(&self, text: &str) -> Redacted {
        let mut out = Cow::Borrowed(text);
        for secret in &self.secrets {
            if out.contains(secret.as_str()) {
                out = Cow::Owned(cut_out(&out, secret));
            }
        }
        let shaped = match &*SHAPE_PATTERN {
            Some(re) => match re.replace_all(&out, keep_names) {
                Cow::Borrowed(_) => out.into_owned(),
                Cow::Owned(s) => s,
            },
            None => "<the provider's text is withheld>".to_owned(),
        };
        Redacted(Cow::Owned(cut(shaped)))
    }
}

/// Secrets shorter than this are cut only where they stand alone: a test's key `k` must not
/// turn "mock" into "moc<redacted>" (and a key that short is no protection anyway).
const WHOLE_WORD_BELOW: usize = 8;

/// `text` with `secret` replaced by [`MARK`]: everywhere, or, for a short secret, where no
/// letter or digit touches it.
fn cut_out(text: &str, secret: &str) -> String {
    if secret.chars().count() >= WHOLE_WORD_BELOW {
        return text.replace(secret, MARK);
    }
    let word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for (at, _) in text.match_indices(secret) {
        let end = at + secret.len();
        if word(text[..at].chars().next_back()) || word(text[end..].chars().next()) {
            continue;
        }
        out.push_str(&text[last..at]);
        out.push_str(MARK);
        last = end;
    }
    out.push_str(&text[last..]);
    out
}

/// The replacement of one match: what names the secret, then [`MARK`].
fn keep_names(caps: &regex::Captures<'_>) -> String {
    let kept = ["keep_header", "keep_scheme", "keep_query", "keep_url"]
        .iter()
        .find_map(|name| caps.name(name))
        .map_or("", |m| m.as_str());
    // A URL's password is followed by its `@`, which the match took.
    let at = if caps.name("keep_url").is_some() {
        "@"
    } else {
        ""
    };
    format!("{kept}{MARK}{at}")
}

/// `text` whole up to [`UPSTREAM_TEXT_MAX_CHARS`] characters, else cut there with its length.
fn cut(text: String) -> String {
    match text.char_indices().nth(UPSTREAM_TEXT_MAX_CHARS) {
        None => text,
        Some((at, _)) => format!("{}… ({} bytes in all)", &text[..at], text.len()),
    }
}

/// `s` as it appears in a URL's query (RFC 3986 unreserved characters kept).
fn url_encoded(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Whether `text` has a credential's shape (`sk-…`, `AKIA…`, `Bearer …`, a URL with a
/// password, …): configuration checks refuse to echo such a value.
#[must_use]
pub fn looks_like_credential(text: &str) -> bool {
    SHAPE_PATTERN.as_ref().is_none_or(|re| re.is_match(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPAQUE: &str = "opaque-credential-9b1f2e77";

    fn redact(text: &str) -> String {
        Redactor::new([OPAQUE, "p@ss/word+1"])
            .redact(text)
            .as_str()
            .to_owned()
    }

    #[test]
    fn the_shape_pattern_compiles() {
        assert!(SHAPE_PATTERN.is_some());
    }

    #[test]
    fn configured_secrets_are_cut_wherever_they_appear() {
        assert_eq!(
            redact(&format!("bad key {OPAQUE}; again:{OPAQUE}.")),
            "bad key <redacted>; again:<redacted>."
        );
        // Its URL-encoded form too (a key in a query string).
        assert_eq!(
            redact("GET /v1?k=p%40ss%2Fword%2B1 and p@ss/word+1"),
            "GET /v1?k=<redacted> and <redacted>"
        );
        // A short secret only where it stands alone.
        let short = Redactor::new(["k1"]);
        assert_eq!(
            short.redact("key k1 (k1) in k10 or ak1").as_str(),
            "key <redacted> (<redacted>) in k10 or ak1"
        );
        // A secret that holds another is cut whole.
        let r = Redactor::new(["abc123456789", "abc123456789-and-more"]);
        assert_eq!(
            r.redact("x abc123456789-and-more y").as_str(),
            "x <redacted> y"
        );
    }

    #[test]
    fn credential_shapes_are_cut_and_what_names_them_is_kept() {
        let cases = [
            ("Authorization: Bearer abc.def-ghi", "Authorization: <redacted>"),
            ("got bearer tok_12345678 from you", "got bearer <redacted> from you"),
            ("key sk-proj-AbCdEf0123456789_xyz is wrong", "key <redacted> is wrong"),
            ("sk-ant-api03-AbCdEf0123456789 invalid", "<redacted> invalid"),
            ("Credential=AKIAIOSFODNN7EXAMPLE/20250101", "Credential=<redacted>/20250101"),
            ("token ASIAY34FZKBOKMUTVV7A expired", "token <redacted> expired"),
            (r#"{"x-api-key": "zzz-123", "b": 1}"#, r#"{"x-api-key": "<redacted>", "b": 1}"#),
            ("api-key:abcdef;next", "api-key:<redacted>;next"),
            ("X-Goog-Api-Key = AIzaSyD-abc", "X-Goog-Api-Key = <redacted>"),
            ("x-amz-security-token:FwoGZX+/= rest", "x-amz-security-token:<redacted> rest"),
            (
                "GET https://g.example/v1/models/m:generateContent?alt=sse&key=AIzaXYZ&x=1 failed",
                "GET https://g.example/v1/models/m:generateContent?alt=sse&key=<redacted>&x=1 failed",
            ),
            ("redis://:hunter2@10.0.0.1:6379/0 down", "redis://:<redacted>@10.0.0.1:6379/0 down"),
            ("https://bob:pw@h/x", "https://bob:<redacted>@h/x"),
            (
                "a Google key AIzaSyA1234567890abcdefghijklmnopqrstu here",
                "a Google key <redacted> here",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(redact(text), want, "{text}");
        }
    }

    #[test]
    fn ordinary_words_are_left_alone() {
        for text in [
            "HTTP 503: the model is overloaded, try again later",
            "prompt is too long: 210000 tokens > 200000 maximum",
            "a task-force of skeptics; risk-averse",
            "connection failed: tcp connect error: Connection refused (os error 111)",
            "https://api.openai.com/v1/chat/completions",
        ] {
            assert_eq!(redact(text), text);
        }
    }

    #[test]
    fn long_texts_are_cut_after_redaction() {
        let long = format!("{}{OPAQUE}", "x".repeat(UPSTREAM_TEXT_MAX_CHARS - 3));
        let out = redact(&long);
        assert!(!out.contains("opaque") && !out.contains(OPAQUE), "{out}");
        assert!(out.starts_with(&"x".repeat(UPSTREAM_TEXT_MAX_CHARS - 3)));
        assert!(out.ends_with(" bytes in all)"), "{out}");
        assert_eq!(redact("short"), "short");
    }

    #[test]
    fn credential_shapes_are_recognised_and_variable_names_are_not() {
        for key in [
            "sk-proj-AbCdEf0123456789",
            "AKIAIOSFODNN7EXAMPLE",
            "Bearer abc",
            "redis://:pw@host:6379",
        ] {
            assert!(looks_like_credential(key), "{key}");
        }
        for name in ["OPENAI_API_KEY", "AWS_ACCESS_KEY_ID", "GW_KEY_2"] {
            assert!(!looks_like_credential(name), "{name}");
        }
    }
}
