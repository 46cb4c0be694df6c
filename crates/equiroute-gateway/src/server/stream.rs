//! Stream: what a provider's server-sent events say, read whole and checked (an event that
//! is not JSON, an error event, the end marker, a `finish_reason`, whether content was sent,
//! the text kept for a continuation, the answering model written into each chunk), and the
//! hold: the start of a stream read before anything is sent, so that a stream that breaks
//! early still falls back.

use crate::config::first_byte::{ResumeMode, StreamHold};
use crate::upstream::dialect::event_end;
use crate::upstream::ChunkStream;
use bytes::Bytes;
use equiroute_core::{Millis, TokenEstimate};
use std::ops::Range;
use std::time::Duration;

/// What holding the start of a stream came to.
pub(super) enum Held {
    /// Send `first` (every byte read so far), then relay `rest`.
    Commit { first: Bytes, rest: ChunkStream },
    /// The stream broke, stalled or started malformed before anything was sent.
    Broken(String),
}

/// Reads the start of a stream without sending it, for as long as `policy` says (see
/// [`StreamHold`](crate::config::first_byte::StreamHold)), checking each event as the relay
/// does; with no hold configured, commits at once.
pub(super) async fn hold(
    policy: StreamHold,
    idle: Millis,
    first: Bytes,
    mut rest: ChunkStream,
) -> Held {
    use futures_util::StreamExt;
    if !policy.is_on() {
        return Held::Commit { first, rest };
    }
    // Without a timed hold, `until` is now: only the content gate holds.
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(policy.ms / 1000.0);
    let idle = Duration::from_secs_f64(idle.0 / 1000.0);
    let mut scan = SseScan::default();
    let mut held = Vec::with_capacity(first.len());
    let mut next = Some(first);
    loop {
        if let Some(bytes) = next.take() {
            held.extend_from_slice(&bytes);
            if let (_, Err(why)) = scan.feed(&bytes) {
                return Held::Broken(why);
            }
        }
        let now = tokio::time::Instant::now();
        let timed_over = !policy.is_timed()
            || now >= until
            || (policy.events > 0 && scan.seen.data_events >= policy.events);
        let content_gate = !policy.until_content || scan.seen.content;
        if (timed_over && content_gate) || scan.seen.done || held.len() >= StreamHold::MAX_BYTES {
            return Held::Commit {
                first: Bytes::from(held),
                rest,
            };
        }
        let wait = if timed_over {
            idle
        } else {
            (until - now).min(idle)
        };
        match tokio::time::timeout(wait, rest.next()).await {
            // The timed hold is over before the stream was silent for its idle limit.
            Err(_) if !timed_over && tokio::time::Instant::now() >= until => {}
            Err(_) => {
                return Held::Broken(format!(
                    "the provider's stream stalled for more than {:.0} ms",
                    idle.as_secs_f64() * 1000.0
                ));
            }
            Ok(Some(Err(reason))) => return Held::Broken(reason),
            Ok(Some(Ok(bytes))) => next = Some(bytes),
            Ok(None) => {
                // The whole answer arrived within the hold: send it if it is complete.
                return match scan.end() {
                    (_, Err(why)) => Held::Broken(why),
                    (_, Ok(())) if scan.seen.done || scan.seen.finished => Held::Commit {
                        first: Bytes::from(held),
                        rest: Box::pin(futures_util::stream::empty()),
                    },
                    (_, Ok(())) => Held::Broken("the provider's stream ended before [DONE]".into()),
                };
            }
        }
    }
}

/// The longest server-sent event the relay holds while it waits for the event's end.
pub(super) const MAX_EVENT_BYTES: usize = 1 << 20;

/// Splits a relayed stream into whole server-sent events and reads each: `[DONE]`, a chunk
/// with a `finish_reason`, an error the provider sent mid-stream, or `data` that is not JSON
/// (which no client could read: the stream is broken there, and that event is not relayed).
#[derive(Default)]
pub(super) struct SseScan {
    /// Bytes of an event whose end has not arrived yet.
    pub(super) pending: Vec<u8>,
    pub(super) seen: Seen,
    /// After a prefix continuation: the whitespace the prefill left out (the client has it),
    /// dropped from the start of the continuation's text so the seam reads as one answer.
    pub(super) seam: String,
    /// The candidate's configured model, as JSON text: written over each chunk's top-level
    /// `model` where the provider sent another name (an OpenAI or Azure deployment's own), the
    /// rule of unstreamed answers (`ProviderJson::with_model`). `None`: chunks as they came.
    pub(super) model: Option<Vec<u8>>,
}

/// What the events read so far said.
#[derive(Default)]
pub(super) struct Seen {
    /// `data: [DONE]` was seen.
    pub(super) done: bool,
    /// A chunk carried a `finish_reason`.
    pub(super) finished: bool,
    /// Data events read (chunks, not counting `[DONE]`).
    pub(super) data_events: u64,
    /// An event carried content: text, a tool call, any delta member but `role`, or a
    /// `finish_reason` (what a client shows; kept across a continuation's streams).
    pub(super) content: bool,
    /// The answer's text so far, when a broken stream may be continued.
    pub(super) kept: Option<Kept>,
    /// The token usage the provider reported in the stream, if it did: what the attempt is
    /// billed by, as an unstreamed answer is.
    pub(super) usage: Option<TokenEstimate>,
}

/// The assistant text a relayed answer has sent, kept (up to `cap` bytes) so that a broken
/// stream can be continued from it.
#[derive(Debug, Default)]
pub(super) struct Kept {
    pub(super) text: String,
    pub(super) cap: usize,
    /// Why the answer cannot be continued, once it cannot (the text is no longer kept).
    pub(super) unfit: Option<&'static str>,
}

impl Kept {
    pub(super) fn take(&mut self, choices: &[ChoicePeek]) {
        if self.unfit.is_some() {
            return;
        }
        for ch in choices {
            let Some(delta) = &ch.delta else { continue };
            let unfit = if ch.index != 0 {
                Some("the answer has more than one choice")
            } else if delta.tool_calls.is_some() || delta.function_call.is_some() {
                Some("the answer calls tools")
            } else {
                let text = delta.content.as_deref().unwrap_or_default();
                if self.text.len() + text.len() > self.cap {
                    Some("the answer is longer than stream_resume.max_kept_bytes")
                } else {
                    self.text.push_str(text);
                    None
                }
            };
            if unfit.is_some() {
                self.unfit = unfit;
                self.text = String::new();
                return;
            }
        }
    }
}

/// The parts of a chat chunk the relay reads; the rest is only checked to be JSON.
#[derive(serde::Deserialize)]
pub(super) struct ChunkPeek<'a> {
    /// The top-level `model`, as its text in the event (where it lies: `SseScan::model`).
    #[serde(borrow, default)]
    pub(super) model: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    pub(super) choices: Vec<ChoicePeek>,
    #[serde(default)]
    pub(super) error: Option<serde::de::IgnoredAny>,
    /// The usage chunk (`stream_options.include_usage`, and every native dialect's stream).
    #[serde(default)]
    pub(super) usage: Option<UsagePeek>,
}

#[derive(serde::Deserialize)]
pub(super) struct UsagePeek {
    pub(super) prompt_tokens: Option<u32>,
    pub(super) completion_tokens: Option<u32>,
}

#[derive(serde::Deserialize)]
pub(super) struct ChoicePeek {
    #[serde(default)]
    pub(super) index: u64,
    #[serde(default)]
    pub(super) finish_reason: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    pub(super) delta: Option<DeltaPeek>,
}

/// The parts of a chunk's delta a continuation needs, and the rest (reasoning, refusal …),
/// to tell content from a role-only or empty delta.
#[derive(serde::Deserialize)]
pub(super) struct DeltaPeek {
    #[serde(default)]
    pub(super) content: Option<String>,
    #[serde(default)]
    pub(super) tool_calls: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    pub(super) function_call: Option<serde::de::IgnoredAny>,
    #[serde(flatten)]
    pub(super) rest: serde_json::Map<String, serde_json::Value>,
}

impl DeltaPeek {
    /// Whether the delta carries anything a client shows: not only a role, nor only empties.
    pub(super) fn carries_content(&self) -> bool {
        let shown = |v: &serde_json::Value| match v {
            serde_json::Value::Null => false,
            serde_json::Value::String(s) => !s.is_empty(),
            serde_json::Value::Array(a) => !a.is_empty(),
            serde_json::Value::Object(o) => !o.is_empty(),
            serde_json::Value::Bool(_) | serde_json::Value::Number(_) => true,
        };
        self.content.as_deref().is_some_and(|c| !c.is_empty())
            || self.tool_calls.is_some()
            || self.function_call.is_some()
            || self.rest.iter().any(|(k, v)| k != "role" && shown(v))
    }
}

impl SseScan {
    /// A scan that keeps the answer's text, up to `cap` bytes, when `cap` is given.
    pub(super) fn keeping(cap: Option<usize>) -> SseScan {
        let mut scan = SseScan::default();
        scan.seen.kept = cap.map(|cap| Kept {
            cap,
            ..Kept::default()
        });
        scan
    }

    /// Writes `model` (the answering candidate's configured model) into each chunk relayed
    /// from now on.
    pub(super) fn answering(&mut self, model: &str) {
        self.model = serde_json::to_vec(model).ok();
    }

    /// Starts on a continuation's stream: the events are read afresh; the text kept goes on
    /// after a prefix continuation, and starts again after a restart (the continuing
    /// candidate's model is set anew with [`SseScan::answering`]).
    pub(super) fn next_stream(&mut self, mode: ResumeMode) {
        let mut kept = self.seen.kept.take();
        if let (Some(k), ResumeMode::Restart) = (&mut kept, mode) {
            k.text.clear();
            k.unfit = None;
        }
        let content = self.seen.content;
        *self = SseScan::default();
        if let (Some(k), ResumeMode::Prefix) = (&kept, mode) {
            self.seam = k.text[k.text.trim_end().len()..].to_owned();
        }
        self.seen.kept = kept;
        self.seen.content = content;
    }

    /// Takes the next bytes; returns the whole events they complete (to relay) and whether
    /// the stream is still sound (`Err`: why it is broken; the bad event is not returned).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> (Bytes, Result<(), String>) {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some((end, next)) = event_end(&self.pending[start..]) {
            let event = &self.pending[start..start + end];
            let sewn = (!self.seam.is_empty())
                .then(|| sew(event, &mut self.seam))
                .flatten();
            let read = sewn.as_deref().unwrap_or(event);
            let renamed = match self.seen.read(read) {
                Err(why) => {
                    self.pending.clear();
                    return (Bytes::from(out), Err(why));
                }
                Ok(span) => renamed(read, span, self.model.as_deref()),
            };
            match renamed.or(sewn) {
                Some(event) => {
                    out.extend_from_slice(&event);
                    out.extend_from_slice(b"\n\n");
                }
                None => out.extend_from_slice(&self.pending[start..start + next]),
            }
            start += next;
        }
        self.pending.drain(..start);
        if self.pending.len() > MAX_EVENT_BYTES {
            let why = format!(
                "the provider sent an event longer than {MAX_EVENT_BYTES} bytes without its end"
            );
            return (Bytes::from(out), Err(why));
        }
        (Bytes::from(out), Ok(()))
    }

    /// At a clean end of the body: what is left is the last event (e.g. `data: [DONE]\n`
    /// without its blank line).
    pub(super) fn end(&mut self) -> (Bytes, Result<(), String>) {
        let rest = std::mem::take(&mut self.pending);
        if rest.iter().all(u8::is_ascii_whitespace) {
            return (Bytes::new(), Ok(()));
        }
        match self.seen.read(&rest) {
            Ok(span) => match renamed(&rest, span, self.model.as_deref()) {
                Some(event) => (Bytes::from(event), Ok(())),
                None => (Bytes::from(rest), Ok(())),
            },
            Err(why) => (Bytes::new(), Err(why)),
        }
    }
}

/// `event` with the `model` at `span` replaced by `model` (JSON text), when they differ;
/// `None`: the event is relayed as it came.
fn renamed(event: &[u8], span: Option<Range<usize>>, model: Option<&[u8]>) -> Option<Vec<u8>> {
    let (span, model) = (span?, model?);
    if event.get(span.clone())? == model {
        return None;
    }
    let mut out = Vec::with_capacity(event.len() - span.len() + model.len());
    out.extend_from_slice(&event[..span.start]);
    out.extend_from_slice(model);
    out.extend_from_slice(&event[span.end..]);
    Some(out)
}

/// The first text event of a prefix continuation (a one-line `data:` chunk whose choice 0
/// has text) without the leading whitespace that `seam` (the whitespace the client already
/// has) covers; `seam` is then spent. `None`: not such an event, relayed as it came.
pub(super) fn sew(event: &[u8], seam: &mut String) -> Option<Vec<u8>> {
    let data = std::str::from_utf8(event)
        .ok()?
        .trim_end()
        .strip_prefix("data:")?;
    if data.contains('\n') {
        return None;
    }
    let mut chunk: serde_json::Value = serde_json::from_str(data).ok()?;
    let content = chunk.pointer_mut("/choices/0/delta/content")?;
    let text = content.as_str().filter(|t| !t.is_empty())?;
    let owed: usize = text
        .chars()
        .zip(seam.chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.len_utf8())
        .sum();
    *content = serde_json::Value::String(text[owed..].to_owned());
    seam.clear();
    Some(format!("data: {chunk}").into_bytes())
}

impl Seen {
    /// Reads one event (without its blank line); returns where the chunk's top-level `model`
    /// value lies in `event`, when it is a one-line `data:` chunk with one.
    pub(super) fn read(&mut self, event: &[u8]) -> Result<Option<Range<usize>>, String> {
        let mut data: Vec<u8> = Vec::new();
        let mut lines = 0;
        // Where the first `data:` line's value starts in `event`.
        let mut data_at = 0;
        let mut line_at = 0;
        for line in event.split(|&b| b == b'\n') {
            let at = line_at;
            line_at += line.len() + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(d) = line.strip_prefix(b"data:") {
                let d = d.strip_prefix(b" ").unwrap_or(d);
                if lines > 0 {
                    data.push(b'\n');
                } else {
                    data_at = at + line.len() - d.len();
                }
                data.extend_from_slice(d);
                lines += 1;
            }
        }
        if lines == 0 || self.done {
            // A comment or keep-alive, or whatever follows the end marker.
            return Ok(None);
        }
        if data.trim_ascii() == b"[DONE]" {
            self.done = true;
            return Ok(None);
        }
        match serde_json::from_slice::<ChunkPeek<'_>>(&data) {
            Err(_) => Err("the provider sent an event that is not JSON".into()),
            Ok(c) if c.error.is_some() => Err("the provider sent an error mid-stream".into()),
            Ok(c) => {
                self.data_events += 1;
                if c.choices.iter().any(|ch| ch.finish_reason.is_some()) {
                    self.finished = true;
                    self.content = true;
                }
                if c.choices
                    .iter()
                    .any(|ch| ch.delta.as_ref().is_some_and(DeltaPeek::carries_content))
                {
                    self.content = true;
                }
                if let Some(kept) = &mut self.kept {
                    kept.take(&c.choices);
                }
                if let Some(UsagePeek {
                    prompt_tokens: Some(input),
                    completion_tokens: Some(output),
                }) = c.usage
                {
                    self.usage = Some(TokenEstimate { input, output });
                }
                // The value's place in `data`, which is the event's text from `data_at` when
                // the event has one data line.
                Ok(c.model.filter(|_| lines == 1).map(|m| {
                    let start = m.get().as_ptr() as usize - data.as_ptr() as usize + data_at;
                    start..start + m.get().len()
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_relayed_whole_across_chunk_boundaries() {
        let mut scan = SseScan::default();
        let (out, ok) = scan.feed(b"data: {\"choices\":[{\"finish_reason\":null}]}\n\nda");
        assert_eq!(ok, Ok(()));
        assert_eq!(
            &out[..],
            b"data: {\"choices\":[{\"finish_reason\":null}]}\n\n"
        );
        assert!(!scan.seen.finished);
        let (out, ok) =
            scan.feed(b"ta: {\"choices\":[{\"finish_reason\":\"stop\"}]}\r\n\r\ndata: [DO");
        assert_eq!(ok, Ok(()));
        assert!(out.starts_with(b"data: {") && out.ends_with(b"\r\n\r\n"));
        assert!(scan.seen.finished && !scan.seen.done);
        // The end marker without its blank line, at the end of the body.
        let (out, ok) = scan.feed(b"NE]\n");
        assert_eq!((out.len(), ok), (0, Ok(())));
        let (out, ok) = scan.end();
        assert_eq!((&out[..], ok), (&b"data: [DONE]\n"[..], Ok(())));
        assert!(scan.seen.done);
    }

    #[test]
    fn the_text_sent_is_kept_for_a_continuation_until_it_cannot_be_continued() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        let mut scan = SseScan::keeping(Some(10));
        let _ = scan.feed(chunk(r#"{"role":"assistant","content":""}"#).as_bytes());
        let _ = scan.feed(chunk(r#"{"content":"Hello, "}"#).as_bytes());
        let _ = scan.feed(chunk(r#"{"content":"wor"}"#).as_bytes());
        let kept = scan.seen.kept.as_ref().unwrap();
        assert_eq!((kept.text.as_str(), kept.unfit), ("Hello, wor", None));
        // One byte more than the cap: no longer continued, the text let go.
        let _ = scan.feed(chunk(r#"{"content":"ld"}"#).as_bytes());
        let kept = scan.seen.kept.as_ref().unwrap();
        assert_eq!(kept.text, "");
        assert!(kept.unfit.unwrap().contains("max_kept_bytes"));
        // A restart keeps text afresh; a tool call makes the answer unfit.
        scan.next_stream(super::ResumeMode::Restart);
        let _ = scan.feed(chunk(r#"{"content":"Hi"}"#).as_bytes());
        assert_eq!(scan.seen.kept.as_ref().unwrap().text, "Hi");
        let _ =
            scan.feed(chunk(r#"{"tool_calls":[{"index":0,"function":{"name":"f"}}]}"#).as_bytes());
        assert_eq!(
            scan.seen.kept.as_ref().unwrap().unfit,
            Some("the answer calls tools")
        );
        // Without stream_resume nothing is kept.
        let mut scan = SseScan::default();
        let _ = scan.feed(chunk(r#"{"content":"Hello"}"#).as_bytes());
        assert!(scan.seen.kept.is_none());
    }

    #[test]
    fn a_role_or_empty_delta_is_not_content_and_anything_a_client_shows_is() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        for (delta, content) in [
            (r#"{"role":"assistant","content":""}"#, false),
            (
                r#"{"role":"assistant","content":null,"refusal":null}"#,
                false,
            ),
            ("{}", false),
            (r#"{"content":"H"}"#, true),
            (r#"{"reasoning_content":"thinking"}"#, true),
            (r#"{"tool_calls":[{"index":0}]}"#, true),
        ] {
            let mut scan = SseScan::default();
            let (_, ok) = scan.feed(chunk(delta).as_bytes());
            assert_eq!((ok, scan.seen.content), (Ok(()), content), "{delta}");
        }
        let mut scan = SseScan::default();
        let _ = scan.feed(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        );
        assert!(
            scan.seen.content,
            "an empty answer's end is what the client shows"
        );
    }

    #[test]
    fn a_prefix_continuation_drops_the_whitespace_the_client_already_has_once() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        let mut scan = SseScan::keeping(Some(100));
        let _ = scan.feed(chunk(r#"{"content":"mock "}"#).as_bytes());
        scan.next_stream(super::ResumeMode::Prefix);
        assert_eq!(scan.seam, " ");
        // A role chunk without text passes as it came; the seam waits for text.
        let role = chunk(r#"{"role":"assistant","content":""}"#);
        let (out, _) = scan.feed(role.as_bytes());
        assert_eq!((&out[..], scan.seam.as_str()), (role.as_bytes(), " "));
        let (out, ok) = scan.feed(chunk(r#"{"content":" streamed "}"#).as_bytes());
        assert_eq!(ok, Ok(()));
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(
            text.contains(r#""content":"streamed ""#) && text.ends_with("\n\n"),
            "{text}"
        );
        assert_eq!(scan.seen.kept.as_ref().unwrap().text, "mock streamed ");
        // Spent: later text is relayed as it came.
        let later = chunk(r#"{"content":" answer"}"#);
        assert_eq!(&scan.feed(later.as_bytes()).0[..], later.as_bytes());
    }

    #[test]
    fn every_chunk_names_the_configured_model_as_an_unstreamed_answer_does() {
        let mut scan = SseScan::default();
        scan.answering("gpt-4o");
        let (out, ok) = scan.feed(
            b"data: {\"id\":\"c\",\"model\":\"gpt-4o-2024-08-06\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\r\n\r\ndata:{\"model\" : \"dep\\\"x\",\"choices\":[]}\n\nda",
        );
        assert_eq!(ok, Ok(()));
        assert_eq!(
            String::from_utf8(out.to_vec()).unwrap(),
            "data: {\"id\":\"c\",\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n\
             data:{\"model\" : \"gpt-4o\",\"choices\":[]}\n\n"
        );
        assert!(scan.seen.content);
        // The configured name already there: the bytes as they came; no model: as they came.
        let same = b"data: {\"model\":\"gpt-4o\",\"choices\":[]}\r\n\r\n";
        let (out, _) = scan.feed(&[&b"ta: {\"choices\":[]}\n\n"[..], same].concat());
        assert_eq!(
            &out[..],
            &[&b"data: {\"choices\":[]}\n\n"[..], same].concat()[..]
        );
        // The last event, without its blank line, at the end of the body.
        let _ = scan.feed(
            b"data: {\"model\":\"up\",\"choices\":[{\"index\":0,\"finish_reason\":\"stop\"}]}",
        );
        let (out, ok) = scan.end();
        assert_eq!(ok, Ok(()));
        assert!(out.starts_with(b"data: {\"model\":\"gpt-4o\","), "{out:?}");
        // Without a model to write (the hold's scan), chunks pass as they came.
        let mut scan = SseScan::default();
        let chunk = b"data: {\"model\":\"up\",\"choices\":[]}\n\n";
        assert_eq!(&scan.feed(chunk).0[..], &chunk[..]);
    }

    #[test]
    fn data_that_is_not_json_or_an_error_event_breaks_the_stream() {
        let mut scan = SseScan::default();
        let (out, ok) = scan.feed(b": keep-alive\n\ndata: {\"choices\": [\n\ndata: {}\n\n");
        assert_eq!(
            &out[..],
            b": keep-alive\n\n",
            "the bad event is not relayed"
        );
        assert!(ok.is_err());
        let mut scan = SseScan::default();
        let (_, ok) = scan.feed(b"data: {\"error\": {\"message\": \"overloaded\"}}\n\n");
        assert_eq!(ok, Err("the provider sent an error mid-stream".into()));
        let mut scan = SseScan::default();
        let (_, ok) = scan.feed(&vec![b'x'; super::MAX_EVENT_BYTES + 1]);
        assert!(
            ok.is_err(),
            "an event without an end is not held without bound"
        );
    }
}
