//! The client's request body as it goes on to a provider.
//!
//! The gateway parses the client's JSON once, for routing (model, messages, the query text),
//! and keeps the bytes it came as. A chat provider gets those bytes with the top-level
//! `model`, `stream` and `service_tier` members left out and its own appended: the members are
//! found by one scan for their boundaries (strings skipped with `memchr`), and copied, instead
//! of serialising the parsed tree again for every attempt, which escapes every string of a
//! long prompt anew. A body the scan does not expect (a key written with escapes, which could
//! spell `model`) is serialised from the tree as before.
//!
//! Spliced members also go on exactly as the client wrote them: a number is not read into a
//! float and written back (`serde_json`'s default parser may land one ulp off).

use bytes::Bytes;
use serde_json::Value;

/// The client's JSON body: the parsed tree and the bytes it was parsed from.
#[derive(Clone, Debug)]
pub struct ClientBody {
    json: Value,
    raw: Bytes,
}

impl ClientBody {
    /// Parses `raw`; the bytes are kept to be sent on.
    ///
    /// The bytes are checked for UTF-8 once, then parsed as text. Parsed from bytes, every
    /// string kept in the tree was checked on its own, a call each: a chat body's dozen short
    /// strings cost more than the one pass. The same bodies are accepted (JSON is UTF-8, and
    /// outside a string a byte that is not ASCII is a syntax error anyway).
    ///
    /// # Errors
    /// `raw` is not UTF-8, or not JSON.
    pub fn parse(raw: Bytes) -> Result<ClientBody, serde_json::Error> {
        let text = std::str::from_utf8(&raw).map_err(|e| {
            <serde_json::Error as serde::de::Error>::custom(format_args!(
                "the byte at offset {} is not UTF-8 (JSON must be sent as UTF-8)",
                e.valid_up_to()
            ))
        })?;
        Ok(ClientBody {
            json: serde_json::from_str(text)?,
            raw,
        })
    }

    /// A body built by the gateway itself (the judge's request).
    #[must_use]
    pub fn from_json(json: Value) -> ClientBody {
        let raw = Bytes::from(serde_json::to_vec(&json).unwrap_or_default());
        ClientBody { json, raw }
    }

    /// The parsed tree.
    #[must_use]
    pub fn json(&self) -> &Value {
        &self.json
    }

    /// The body for a provider: as it came when `model` is `None` (JSON APIs); otherwise the
    /// client's members but `model`, `stream` and `service_tier`, then the provider's.
    #[must_use]
    pub fn for_provider(
        &self,
        model: Option<&str>,
        stream: bool,
        service_tier: Option<&str>,
    ) -> Bytes {
        let Some(model) = model else {
            return self.raw.clone();
        };
        let mut out = Vec::with_capacity(self.raw.len() + 64);
        out.push(b'{');
        if splice_members(&self.raw, &mut out).is_none() {
            out.clear();
            let tree = serde_json::to_vec(&WithoutReplaced(&self.json)).unwrap_or_default();
            // `{...}` without its closing brace, then a comma if it had members.
            out.extend_from_slice(&tree[..tree.len().saturating_sub(1)]);
            if out.len() > 1 {
                out.push(b',');
            }
        }
        out.extend_from_slice(b"\"model\":");
        // Writing a string into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, model);
        out.extend_from_slice(if stream {
            b",\"stream\":true"
        } else {
            b",\"stream\":false"
        });
        if let Some(tier) = service_tier {
            out.extend_from_slice(b",\"service_tier\":");
            let _ = serde_json::to_writer(&mut out, tier);
        }
        out.push(b'}');
        Bytes::from(out)
    }
}

impl std::ops::Deref for ClientBody {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.json
    }
}

/// Whether a top-level member is replaced by the provider's own (`key` is raw, unquoted).
fn replaced(key: &[u8]) -> bool {
    matches!(key, b"model" | b"stream" | b"service_tier")
}

/// The members of an object but those [`replaced`], serialised from the tree.
struct WithoutReplaced<'a>(&'a Value);

impl serde::Serialize for WithoutReplaced<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        if let Some(obj) = self.0.as_object() {
            for (k, v) in obj {
                if !replaced(k.as_bytes()) {
                    map.serialize_entry(k, v)?;
                }
            }
        }
        map.end()
    }
}

/// Appends each member of the JSON object `raw` but those [`replaced`] to `out`, as
/// `"key": value,`. `None` when `raw` is not an object or a key contains an escape (it could
/// spell a replaced key); `out` then holds a part. `raw` must be valid JSON (it was parsed):
/// the scan checks only what it relies on and gives up on anything else.
fn splice_members(raw: &[u8], out: &mut Vec<u8>) -> Option<()> {
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut first = true;
    loop {
        i = skip_ws(raw, i);
        match raw.get(i)? {
            b'}' => return Some(()),
            b',' if !first => {
                i = skip_ws(raw, i + 1);
            }
            _ if first => {}
            _ => return None,
        }
        first = false;
        if raw.get(i) != Some(&b'"') {
            return None;
        }
        let start = i;
        let key_end = string_end(raw, i)?;
        let key = &raw[start + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None;
        }
        i = skip_ws(raw, key_end);
        if raw.get(i) != Some(&b':') {
            return None;
        }
        let end = value_end(raw, skip_ws(raw, i + 1))?;
        if !replaced(key) {
            out.extend_from_slice(&raw[start..end]);
            out.push(b',');
        }
        i = end;
    }
}

fn skip_ws(raw: &[u8], mut i: usize) -> usize {
    while matches!(raw.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The index just past the string that opens at `raw[i] == '"'`.
fn string_end(raw: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', raw.get(j..)?)?;
        if raw[j] == b'\\' {
            j += 2;
        } else {
            return Some(j + 1);
        }
    }
}

/// The index just past the value that starts at `i` (its last byte, not trailing space).
fn value_end(raw: &[u8], mut i: usize) -> Option<usize> {
    let mut depth = 0usize;
    loop {
        match *raw.get(i)? {
            b'"' => {
                i = string_end(raw, i)?;
                if depth == 0 {
                    return Some(i);
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                if depth == 0 {
                    // The enclosing object ends: a scalar value ended before it.
                    return Some(trim_end(raw, i));
                }
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            b',' if depth == 0 => return Some(trim_end(raw, i)),
            _ => {}
        }
        i += 1;
    }
}

/// The index just past the last non-space byte before `i`.
fn trim_end(raw: &[u8], mut i: usize) -> usize {
    while i > 0 && matches!(raw[i - 1], b' ' | b'\t' | b'\n' | b'\r') {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    /// What the provider must receive: the client's members but the replaced ones, then
    /// the provider's (the tree the serialiser used to write).
    fn expected(body: &Value, model: &str, stream: bool, tier: Option<&str>) -> Value {
        let mut obj = body.as_object().cloned().unwrap_or_default();
        obj.insert("model".into(), json!(model));
        obj.insert("stream".into(), json!(stream));
        match tier {
            Some(t) => obj.insert("service_tier".into(), json!(t)),
            None => obj.remove("service_tier"),
        };
        Value::Object(obj)
    }

    fn sent(raw: &str, model: &str, stream: bool, tier: Option<&str>) -> Value {
        let body = ClientBody::parse(Bytes::from(raw.to_owned())).unwrap();
        let out = body.for_provider(Some(model), stream, tier);
        serde_json::from_slice(&out)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)))
    }

    #[test]
    fn a_body_is_accepted_exactly_when_the_byte_parser_accepts_it() {
        let bodies: [&[u8]; 7] = [
            br#"{"model":"chat","messages":[{"role":"user","content":"h\u00e9llo"}]}"#,
            "{\"content\":\"caf\u{e9} \u{1f600}\"}".as_bytes(),
            b"{\"content\":\"caf\xe9\"}",
            b"{\"content\":\"ok\"}\xff",
            b"{\"a\":1, \xc3\xa9}",
            b"{not json",
            b"",
        ];
        for raw in bodies {
            let ours = ClientBody::parse(Bytes::copy_from_slice(raw));
            let bytes = serde_json::from_slice::<Value>(raw);
            assert_eq!(
                ours.is_ok(),
                bytes.is_ok(),
                "{}",
                String::from_utf8_lossy(raw)
            );
            if let (Ok(a), Ok(b)) = (&ours, &bytes) {
                assert_eq!(a.json(), b);
            }
        }
        // The error names the byte and what to do.
        let e = ClientBody::parse(Bytes::from_static(b"{\"content\":\"caf\xe9\"}")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the byte at offset 15 is not UTF-8 (JSON must be sent as UTF-8)"
        );
    }

    #[test]
    fn members_are_spliced_and_the_providers_fields_replace_the_clients() {
        let raw = r#" {
            "model" : "chat/a",
            "messages": [{"role": "user", "content": "say \"hi\" \\ {not: json} ]"}],
            "stream":false , "temperature" : 0.5, "n":1,
            "service_tier": "auto",
            "metadata": {"model": "nested stays", "stream": [1, {"a": "}"}]},
            "stop": null, "logprobs": true, "x": -1.5e3
        } "#;
        let body: Value = serde_json::from_str(raw).unwrap();
        for (stream, tier) in [(false, None), (true, Some("flex"))] {
            assert_eq!(
                sent(raw, "gpt-x", stream, tier),
                expected(&body, "gpt-x", stream, tier)
            );
        }
        // The scan took this body, not the fallback: the members kept their bytes.
        let out = ClientBody::parse(Bytes::from(raw))
            .unwrap()
            .for_provider(Some("m"), false, None);
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(text.contains(r#""temperature" : 0.5"#), "{text}");
        assert!(text.ends_with(r#","model":"m","stream":false}"#), "{text}");
    }

    #[test]
    fn empty_and_one_member_objects() {
        assert_eq!(
            sent("{}", "m", true, None),
            json!({"model": "m", "stream": true})
        );
        assert_eq!(
            sent(" { } ", "m", false, None),
            json!({"model": "m", "stream": false})
        );
        assert_eq!(
            sent(r#"{"model":"x"}"#, "m\"q", false, Some("priority")),
            json!({"model": "m\"q", "stream": false, "service_tier": "priority"})
        );
        assert_eq!(
            sent(r#"{"a":[]}"#, "m", false, None),
            json!({"a": [], "model": "m", "stream": false})
        );
    }

    #[test]
    fn an_escaped_key_goes_through_the_tree_and_is_still_replaced() {
        let raw = r#"{"mod\u0065l": "client's", "messages": [], "str\u0065am": true}"#;
        assert!(splice_members(raw.as_bytes(), &mut Vec::new()).is_none());
        assert_eq!(
            sent(raw, "m", false, None),
            json!({"messages": [], "model": "m", "stream": false})
        );
    }

    #[test]
    fn json_apis_get_the_bytes_as_they_came() {
        let raw = Bytes::from_static(b"{\"q\": \"a b\",  \"k\": 3}");
        let body = ClientBody::parse(raw.clone()).unwrap();
        assert_eq!(body.for_provider(None, true, Some("flex")), raw);
        assert_eq!(body["k"], json!(3));
    }

    fn value(rng: &mut rand_chacha::ChaCha8Rng, depth: u32, strings: &[&str]) -> Value {
        match rng.random_range(0..if depth > 2 { 4 } else { 6 }) {
            0 => Value::Null,
            1 => json!(rng.random_range(-1e6..1e6)),
            2 => json!(rng.random_bool(0.5)),
            3 => json!(strings[rng.random_range(0..strings.len())]),
            4 => Value::Array(
                (0..rng.random_range(0..4))
                    .map(|_| value(rng, depth + 1, strings))
                    .collect(),
            ),
            _ => Value::Object(
                (0..rng.random_range(0..4))
                    .map(|i| (format!("k{i}"), value(rng, depth + 1, strings)))
                    .collect(),
            ),
        }
    }

    #[test]
    fn random_bodies_splice_to_the_trees_answer() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let keys = [
            "model",
            "stream",
            "service_tier",
            "messages",
            "a",
            "ü",
            "k\"q",
            "n",
        ];
        let strings = [
            "",
            "plain",
            "q\"uote",
            "back\\slash",
            "{[,:]}",
            "tab\there",
            "é😀",
        ];
        for case in 0..500 {
            let mut obj = serde_json::Map::new();
            for _ in 0..rng.random_range(0..6) {
                let k = keys[rng.random_range(0..keys.len())];
                obj.insert(k.into(), value(&mut rng, 0, &strings));
            }
            let body = Value::Object(obj);
            let raw = if case % 2 == 0 {
                serde_json::to_string(&body).unwrap()
            } else {
                serde_json::to_string_pretty(&body).unwrap()
            };
            let tier = (case % 3 == 0).then_some("flex");
            // Read back from text as the splice is: serde_json's default float parser can
            // land one ulp off, the same way for the same digits.
            let want: Value =
                serde_json::from_str(&expected(&body, "prov", case % 5 == 0, tier).to_string())
                    .unwrap();
            assert_eq!(
                sent(&raw, "prov", case % 5 == 0, tier),
                want,
                "case {case}: {raw}"
            );
        }
    }
}
