//! A provider's JSON answer, relayed as the bytes that came: checked to be JSON and read for
//! what the gateway needs (`usage`, where `model` is) in one pass that builds no tree, then
//! sent on with only `model` replaced.

use bytes::Bytes;
use equiroute_core::TokenEstimate;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::ops::Range;

/// A provider's answer body, known to be JSON.
#[derive(Clone, Debug)]
pub struct ProviderJson {
    raw: Bytes,
    /// Where the top-level `model` value lies in `raw`, when the answer is an object with one.
    model_span: Option<Range<usize>>,
    /// `usage.prompt_tokens` and `usage.completion_tokens`, when the provider sent them.
    usage: Option<TokenEstimate>,
    /// The one-pass reading did not apply (not an object, a repeated key, a `usage` of another
    /// shape): edits and reads go through the whole tree instead.
    irregular: bool,
}

/// The fields the gateway reads, borrowed from the answer; every other field is skipped.
#[derive(Deserialize)]
struct Peek<'a> {
    #[serde(borrow, default)]
    model: Span<'a>,
    #[serde(default)]
    usage: Option<PeekUsage>,
}

/// A value kept as its text (`null` included, unlike `Option<&RawValue>`).
#[derive(Default)]
struct Span<'a>(Option<&'a RawValue>);

impl<'de: 'a, 'a> Deserialize<'de> for Span<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a RawValue>::deserialize(d).map(|r| Span(Some(r)))
    }
}

#[derive(Deserialize)]
struct PeekUsage {
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
}

impl ProviderJson {
    /// The answer `raw`, or `None` when it is not JSON.
    #[must_use]
    pub fn parse(raw: Bytes) -> Option<ProviderJson> {
        if let Ok(peek) = serde_json::from_slice::<Peek<'_>>(&raw) {
            let base = raw.as_ptr() as usize;
            let model_span = peek.model.0.map(|m| {
                let start = m.get().as_ptr() as usize - base;
                start..start + m.get().len()
            });
            let usage = peek.usage.and_then(|u| {
                Some(TokenEstimate {
                    input: u.prompt_tokens?,
                    output: u.completion_tokens.unwrap_or(0),
                })
            });
            return Some(ProviderJson {
                raw,
                model_span,
                usage,
                irregular: false,
            });
        }
        let value: Value = serde_json::from_slice(&raw).ok()?;
        Some(ProviderJson {
            usage: usage_of(&value),
            raw,
            model_span: None,
            irregular: true,
        })
    }

    /// An answer made here (the simulated providers).
    #[must_use]
    pub fn from_value(value: &Value) -> ProviderJson {
        let raw = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
        ProviderJson::parse(raw).unwrap_or_else(|| ProviderJson {
            raw: Bytes::from_static(b"null"),
            model_span: None,
            usage: None,
            irregular: true,
        })
    }

    /// The provider's token counts, from `usage`.
    #[must_use]
    pub fn usage(&self) -> Option<TokenEstimate> {
        self.usage
    }

    /// The answer as a JSON tree (for the judge and other occasional readers).
    #[must_use]
    pub fn value(&self) -> Option<Value> {
        serde_json::from_slice(&self.raw).ok()
    }

    /// The answer's bytes, as the provider sent them.
    #[must_use]
    pub fn bytes(&self) -> &Bytes {
        &self.raw
    }

    /// The answer with its top-level `model` (if it has one) set to `model`; everything else
    /// byte for byte as the provider sent it.
    #[must_use]
    pub fn with_model(&self, model: &str) -> Bytes {
        if let Some(span) = &self.model_span {
            let name = serde_json::to_vec(model).unwrap_or_default();
            let mut out = Vec::with_capacity(self.raw.len() - span.len() + name.len());
            out.extend_from_slice(&self.raw[..span.start]);
            out.extend_from_slice(&name);
            out.extend_from_slice(&self.raw[span.end..]);
            return Bytes::from(out);
        }
        if self.irregular {
            if let Some(mut value) = self.value() {
                if let Some(obj) = value.as_object_mut() {
                    if obj.contains_key("model") {
                        obj.insert("model".into(), Value::String(model.to_owned()));
                        return Bytes::from(serde_json::to_vec(&value).unwrap_or_default());
                    }
                }
            }
        }
        self.raw.clone()
    }
}

/// Token counts in a tree's `usage`, if any.
fn usage_of(body: &Value) -> Option<TokenEstimate> {
    let usage = body.get("usage")?;
    let count = |k: &str| {
        usage
            .get(k)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    Some(TokenEstimate {
        input: count("prompt_tokens")?,
        output: count("completion_tokens").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str) -> ProviderJson {
        ProviderJson::parse(Bytes::from(text.to_owned())).unwrap_or_else(|| panic!("{text}"))
    }

    #[test]
    fn model_is_replaced_and_everything_else_kept_byte_for_byte() {
        let text = r#"{"id":"x", "model" : "gpt-up\"stream","choices":[{"message":{"content":"hi","model":"inner"}}],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#;
        let a = answer(text);
        let out = String::from_utf8(a.with_model("mock-1").to_vec()).unwrap_or_default();
        assert_eq!(
            out,
            text.replace(r#""gpt-up\"stream""#, r#""mock-1""#),
            "only the top-level model changes"
        );
        assert_eq!(
            a.usage(),
            Some(TokenEstimate {
                input: 7,
                output: 3
            })
        );
        let quoted = a.with_model("say \"hi\"");
        let v: Value = serde_json::from_slice(&quoted).unwrap_or_default();
        assert_eq!(v["model"], "say \"hi\"");
    }

    #[test]
    fn answers_without_model_or_of_other_shapes_are_relayed_as_they_came() {
        for text in [r#"{"results":[1,2]}"#, "[1,2,3]", r#""text""#] {
            let a = answer(text);
            assert_eq!(a.with_model("m").as_ref(), text.as_bytes(), "{text}");
            assert_eq!(a.usage(), None);
        }
        let null_model = answer(r#"{"model":null}"#);
        assert_eq!(null_model.with_model("m").as_ref(), br#"{"model":"m"}"#);
    }

    #[test]
    fn irregular_answers_go_through_the_tree() {
        // A repeated key and a usage with a fractional count: the one-pass reading refuses
        // them, the tree reading gives what the previous version of the gateway gave.
        let repeated = answer(r#"{"model":"a","model":"b","usage":{"prompt_tokens":2}}"#);
        let v: Value = serde_json::from_slice(&repeated.with_model("m")).unwrap_or_default();
        assert_eq!(v["model"], "m");
        assert_eq!(
            repeated.usage(),
            Some(TokenEstimate {
                input: 2,
                output: 0
            })
        );
        let fractional = answer(r#"{"usage":{"prompt_tokens":2.5}}"#);
        assert_eq!(fractional.usage(), None);
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for text in ["", "{", "<html>busy</html>", r#"{"a":1} trailing"#] {
            assert!(
                ProviderJson::parse(Bytes::from(text.to_owned())).is_none(),
                "{text}"
            );
        }
    }
}
