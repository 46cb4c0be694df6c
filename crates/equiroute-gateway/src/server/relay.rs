//! Relay: a committed stream sent to the client event by event; one that breaks, stalls or
//! ends without `[DONE]` is continued on the next candidate when `stream_resume` says so
//! (a prefix continuation or a restart, announced in the stream), else closed with an error
//! event. The relayed attempts and the request's end are booked by the ledger (`book`).

use super::attempt::{
    admit, heard_capacity, learn_first_byte, next_attempt, outcome_of, spent_capacity, streamed,
    usage_of, wait_limit, Awaited, Began, Unlearnt,
};
use super::book::{Answer, AttemptEnd, Booking, RequestEnd};
use super::decide::Decided;
use super::repeated::Repeated;
use super::state::{AppState, InterfaceRuntime};
use super::stream::SseScan;
use crate::config::first_byte::ResumeMode;
use crate::upstream::{ChunkStream, ClientBody, StreamStart, UpstreamRequest};
use bytes::Bytes;
use equiroute_core::executor::Execution;
use equiroute_core::{AttemptStatus, Millis, ProviderFailure, TokenEstimate};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// A committed stream being relayed to the client: the request's execution goes on in the
/// relay task, which records the streamed attempt and audits the request when it ends. A
/// stream that breaks is continued on the next candidate when the interface says so
/// (`stream_resume`): the relay is then on the continuing attempt.
pub(super) struct Relay {
    /// The relayed attempt's place in its provider's capacity, held until its stream ends.
    pub(super) permit: super::capacity::Permit,
    /// The relayed attempt's span (`attempt`), ended when its stream ends.
    pub(super) span: tracing::Span,
    pub(super) tokens: TokenEstimate,
    pub(super) state: Arc<AppState>,
    pub(super) iface: Arc<InterfaceRuntime>,
    /// The candidate whose stream is being relayed.
    pub(super) candidate: usize,
    pub(super) features: Vec<f64>,
    pub(super) request_id: String,
    /// The label of the key that made the request ([`super::RequestMeta::owner`]).
    pub(super) owner: Option<Arc<str>>,
    /// The client reads restart events ([`super::RESTART_HEADER`]).
    pub(super) restart_events: bool,
    /// The request's number (seeds a continuation's attempt).
    pub(super) n: u64,
    /// The client's request, for a continuation.
    pub(super) body: ClientBody,
    pub(super) started: Instant,
    /// What the relayed attempt's latency is counted from.
    pub(super) attempt_clock: Instant,
    pub(super) began: Began,
    /// When the relayed attempt began.
    pub(super) attempt_started: equiroute_core::Timestamp,
    pub(super) run: Execution,
    pub(super) decided: Decided,
}

/// A continuation's stream, started.
pub(super) struct Continued {
    pub(super) first: Bytes,
    pub(super) rest: ChunkStream,
    pub(super) mode: ResumeMode,
}

impl Relay {
    /// Starts relaying in a task; returns the SSE response with the routing headers.
    pub(super) fn start(self, first: Bytes, rest: ChunkStream) -> axum::response::Response {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let body =
            axum::body::Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|item| (item, rx))
            }));
        let mut resp = axum::response::Response::new(body);
        let h = resp.headers_mut();
        h.insert(
            "content-type",
            axum::http::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            "cache-control",
            axum::http::HeaderValue::from_static("no-cache"),
        );
        super::routing_headers(
            h,
            &self.request_id,
            Some(&self.iface.candidates[self.candidate].id.0),
            self.run.attempts() + 1,
        );
        super::dropped_header(h, self.decided.dropped[self.candidate]);
        // The task ends with the upstream stream, the idle limit, or a departed client.
        tokio::spawn(
            self.pump(first, rest, tx)
                .instrument(tracing::Span::current()),
        );
        resp
    }

    /// Relays whole events until the stream ends; returns why it broke, if it did, and
    /// whether the client left.
    pub(super) async fn relay(
        &self,
        events: &mut SseScan,
        first: Bytes,
        mut rest: ChunkStream,
        tx: &tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> (Option<String>, bool) {
        use futures_util::StreamExt;
        let idle = Duration::from_secs_f64(self.iface.stream_idle.0 / 1000.0);
        let mut next = Some(first);
        loop {
            let Some(bytes) = next.take() else {
                match tokio::time::timeout(idle, rest.next()).await {
                    Err(_) => {
                        let why = format!(
                            "the provider's stream stalled for more than {:.0} ms",
                            idle.as_secs_f64() * 1000.0
                        );
                        return (Some(why), false);
                    }
                    Ok(Some(Err(reason))) => return (Some(reason), false),
                    Ok(Some(Ok(bytes))) => next = Some(bytes),
                    Ok(None) => {
                        // A clean end: complete once the last event is read.
                        let (whole, verdict) = events.end();
                        if !whole.is_empty() && tx.send(Ok(whole)).await.is_err() {
                            return (None, true);
                        }
                        return match verdict {
                            Err(why) => (Some(why), false),
                            Ok(()) if events.seen.done => (None, false),
                            // The answer is whole (it has its finish_reason) and the body
                            // ended cleanly: only the end marker is missing, so add it.
                            Ok(()) if events.seen.finished => {
                                let done = Bytes::from_static(b"data: [DONE]\n\n");
                                (None, tx.send(Ok(done)).await.is_err())
                            }
                            Ok(()) => (
                                Some("the provider's stream ended before [DONE]".into()),
                                false,
                            ),
                        };
                    }
                }
                continue;
            };
            let (whole, verdict) = events.feed(&bytes);
            if !whole.is_empty() && tx.send(Ok(whole)).await.is_err() {
                return (None, true);
            }
            if let Err(why) = verdict {
                return (Some(why), false);
            }
        }
    }

    pub(super) async fn pump(
        mut self,
        first: Bytes,
        rest: ChunkStream,
        tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) {
        let resume = self.iface.stream_resume;
        let mut events = SseScan::keeping(resume.is_on().then_some(resume.max_kept_bytes));
        events.answering(&self.iface.candidates[self.candidate].model);
        // The relay runs in the attempt's span: an exported span ends at its last exit.
        let span = self.span.clone();
        let (mut broken, mut client_gone) = self
            .relay(&mut events, first, rest, &tx)
            .instrument(span)
            .await;
        let mut status = self.book_relayed(broken.as_deref(), client_gone, events.seen.usage);
        let mut continuations = 0;
        let mut not_continued = None;
        while let Some(reason) = broken.clone() {
            if let Some(why) = self.unresumable(&events, continuations) {
                not_continued = Some(why);
                break;
            }
            let broke_on = self.candidate;
            let Some(next) = self.open_continuation(&events).await else {
                not_continued = Some(if events.seen.content && !self.restart_events {
                    format!("no provider left takes an assistant prefill, and a restart would repeat the text already sent (a client that drops it on the restart event sends `{}: events`)", super::RESTART_HEADER)
                } else {
                    "no provider could take the continuation".into()
                });
                break;
            };
            continuations += 1;
            let marker = continuation_marker(
                &self.request_id,
                &self.iface.candidates[broke_on].id.0,
                &self.iface.candidates[self.candidate],
                next.mode,
                &reason,
            );
            if tx.send(Ok(marker)).await.is_err() {
                // The client left: the continuation is dropped unread.
                (broken, client_gone) = (None, true);
            } else {
                events.next_stream(next.mode);
                events.answering(&self.iface.candidates[self.candidate].model);
                let span = self.span.clone();
                (broken, client_gone) = self
                    .relay(&mut events, next.first, next.rest, &tx)
                    .instrument(span)
                    .await;
            }
            status = self.book_relayed(broken.as_deref(), client_gone, events.seen.usage);
        }
        if let Some(reason) = &broken {
            let message = match &not_continued {
                Some(why) if resume.is_on() => format!("{reason}; not continued: {why}"),
                _ => reason.clone(),
            };
            let event = serde_json::json!({"error": {"message": message, "type": "api_error", "param": null, "code": "stream_broken"}});
            let _ = tx.send(Ok(Bytes::from(format!("data: {event}\n\n")))).await;
        }
        drop(tx);
        let ending = std::time::Instant::now();
        let latency = Millis(ending.duration_since(self.started).as_secs_f64() * 1000.0);
        let end = self.state.at(ending);
        let result = self.run.clone().finish(end);
        let label = match status {
            AttemptStatus::Ok => "ok",
            AttemptStatus::Cancelled => "cancelled",
            _ => "stream_broken",
        };
        let answer = (status == AttemptStatus::Ok).then_some(Answer {
            candidate: self.candidate,
            latency,
            at: end,
            owner: self.owner.as_deref(),
        });
        self.state.ledger(&self.iface).request(
            RequestEnd {
                request_id: &self.request_id,
                decided: &self.decided,
                features: &self.features,
                result: &result,
                label,
                owner: self.owner.as_deref(),
                // A stream's refusal comes before it is relayed, never after.
                content_filter: false,
                at: end,
            },
            answer,
        );
    }

    /// Books the relayed attempt, which ended (`broken`: why it broke), billed by the usage
    /// the provider reported in the stream, else by the request's estimate; returns its status.
    pub(super) fn book_relayed(
        &mut self,
        broken: Option<&str>,
        client_gone: bool,
        usage: Option<TokenEstimate>,
    ) -> AttemptStatus {
        let status = match (broken, client_gone) {
            (Some(_), _) => AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
            (None, true) => AttemptStatus::Cancelled,
            (None, false) => AttemptStatus::Ok,
        };
        let c = &self.iface.candidates[self.candidate];
        let latency = Millis(self.attempt_clock.elapsed().as_secs_f64() * 1000.0);
        if let Some(reason) = broken {
            if self.state.logs.allow(Repeated::StreamBroken) {
                tracing::warn!(request_id = %self.request_id, provider = %c.id, error = %reason, "stream broken");
            }
        } else {
            tracing::debug!(provider = %c.id, outcome = status.as_str(), latency_ms = latency.0, "stream ended");
        }
        let used = usage.unwrap_or(self.tokens);
        spent_capacity(&self.state, &self.iface, self.candidate, used);
        let outcome = streamed(c, used, status, latency, self.began);
        let ctx = Booking::of(&self.features, &self.decided, self.tokens);
        let _ = self.state.ledger(&self.iface).attempt(
            &ctx,
            &mut self.run,
            AttemptEnd {
                span: &self.span,
                candidate: self.candidate,
                next: None,
                started: self.attempt_started,
                outcome,
                usage,
            },
        );
        status
    }

    /// Why a stream that broke is not continued, if it is not.
    pub(super) fn unresumable(&self, events: &SseScan, done: u32) -> Option<String> {
        let resume = self.iface.stream_resume;
        if !resume.is_on() {
            return Some("stream_resume is off".into());
        }
        if done >= resume.max {
            return Some(format!(
                "the request had its {} continuation(s) (stream_resume.max)",
                resume.max
            ));
        }
        if events.seen.finished {
            return Some("the answer had its finish_reason before the break".into());
        }
        let kept = events.seen.kept.as_ref()?;
        if let Some(why) = kept.unfit {
            return Some(why.to_owned());
        }
        // Content without text (reasoning only): no prefix to go on from, and a restart would
        // repeat what the client has.
        if events.seen.content && kept.text.trim().is_empty() && !self.restart_events {
            return Some("the content sent has no text to continue from".into());
        }
        None
    }

    /// Opens the continuation of the broken stream on the next candidate the execution
    /// gives (the breaker admitting it, within the deadline and the attempt limit); attempts
    /// that end before their first byte are booked and passed, as before a commit.
    pub(super) async fn open_continuation(&mut self, events: &SseScan) -> Option<Continued> {
        let state = self.state.clone();
        let iface = self.iface.clone();
        loop {
            let (next, now) = next_attempt(&state, &mut self.run).await?;
            // The stream is committed: a continuation that finds no capacity ends as broken.
            let mut skips = super::capacity::Skips::default();
            let admitted = admit(&state, &iface, (next.candidate, now), &mut skips).await;
            let Some(permit) = admitted.ok()? else {
                self.run.skip();
                continue;
            };
            let candidate = &iface.candidates[next.candidate];
            let Some(mode) = continuation_mode(
                iface.stream_resume.mode,
                iface.prefill[next.candidate],
                events.seen.content,
                self.restart_events,
            ) else {
                // It could only restart, which would repeat the text the client has.
                self.run.skip();
                continue;
            };
            let prefixed = match (mode, &events.seen.kept) {
                (ResumeMode::Prefix, Some(kept)) => with_assistant_prefix(&self.body, &kept.text),
                _ => None,
            };
            let req = UpstreamRequest {
                kind: iface.kind,
                body: prefixed.as_ref().unwrap_or(&self.body),
                model: &candidate.model,
                seed: state.seed_for(self.n)
                    ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb),
            };
            let unlearnt = Unlearnt::of(&self.run, &next, now);
            let limit = wait_limit(
                &iface,
                (next.candidate, Awaited::FirstByte),
                now,
                next.timeout,
                unlearnt,
            )
            .ok()?;
            self.decided
                .first_byte_limits
                .push((next.candidate, now, limit.map(|l| l.0)));
            let clock = Instant::now();
            let span = super::spans::attempt(&iface, next, false);
            let start = iface.upstreams[next.candidate]
                .open_stream(req, limit.map(|t| Duration::from_secs_f64(t.0 / 1000.0)))
                .instrument(span.clone())
                .await;
            let _ = learn_first_byte(&state, &iface, next.candidate, &start, limit);
            match start {
                StreamStart::Started {
                    first,
                    rest,
                    ttfb,
                    capacity,
                } => {
                    heard_capacity(&state, &iface, next.candidate, &capacity);
                    let name = mode.name();
                    tracing::info!(request_id = %self.request_id, provider = %candidate.id, mode = name, "continuing a broken stream");
                    state.metrics.stream_continuation(&iface.name, name);
                    self.decided
                        .continuations
                        .push((next.number as usize, name));
                    self.candidate = next.candidate;
                    self.permit = permit;
                    self.span = span;
                    self.began = Began { ttfb, capacity };
                    self.attempt_started = now;
                    self.attempt_clock = clock;
                    return Some(Continued { first, rest, mode });
                }
                StreamStart::Failed(reply) => {
                    let outcome = outcome_of(&reply, candidate, self.tokens);
                    let ctx = Booking::of(&self.features, &self.decided, self.tokens);
                    let _ = state.ledger(&iface).attempt(
                        &ctx,
                        &mut self.run,
                        AttemptEnd {
                            span: &span,
                            candidate: next.candidate,
                            next: Some(next),
                            started: now,
                            outcome,
                            usage: usage_of(&reply),
                        },
                    );
                }
            }
        }
    }
}

/// How a broken stream goes on, on a candidate that takes a prefill (`prefill`) or not,
/// once the client has had content (`content_sent`) or not: a restart repeats the answer
/// from its beginning, which a client that joins deltas would show after the text it has, so
/// it is chosen only before any content or for a client that reads restart events; else a
/// prefix continuation on a candidate that takes one, or `None` (not on this candidate).
pub(super) fn continuation_mode(
    configured: ResumeMode,
    prefill: bool,
    content_sent: bool,
    restart_events: bool,
) -> Option<ResumeMode> {
    let restart_allowed = !content_sent || restart_events;
    match configured {
        ResumeMode::Off => None,
        ResumeMode::Restart if restart_allowed => Some(ResumeMode::Restart),
        ResumeMode::Prefix | ResumeMode::Restart if prefill && content_sent => {
            Some(ResumeMode::Prefix)
        }
        _ if restart_allowed => Some(ResumeMode::Restart),
        _ => None,
    }
}

/// The client's request with `text` (the partial answer already sent) as a final assistant
/// message, for a provider that continues it; `None` when there is no text to continue.
/// Trailing whitespace is left out: Anthropic refuses a prefill that ends with it.
pub(super) fn with_assistant_prefix(body: &ClientBody, text: &str) -> Option<ClientBody> {
    let text = text.trim_end();
    if text.is_empty() {
        return None;
    }
    let mut json = body.json().clone();
    let messages = json.get_mut("messages")?.as_array_mut()?;
    messages.push(serde_json::json!({"role": "assistant", "content": text}));
    Some(ClientBody::from_json(json))
}

/// The events that announce a continuation in the client's stream: an SSE comment (for a
/// person reading the stream) and a chat chunk with an empty delta on choice 0 (which any
/// OpenAI client reads as no text) and an `equiroute` member saying what happened:
/// `{"event": "continue" | "restart", "from": …, "provider": …, "reason": …}`. After
/// `restart` the answer starts again from its beginning: what came before is to be dropped.
pub(super) fn continuation_marker(
    request_id: &str,
    from: &str,
    to: &equiroute_core::Candidate,
    mode: ResumeMode,
    reason: &str,
) -> Bytes {
    let event = match mode {
        ResumeMode::Restart => "restart",
        ResumeMode::Prefix | ResumeMode::Off => "continue",
    };
    let one_line = reason.replace(['\r', '\n'], " ");
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let chunk = serde_json::json!({
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": to.model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": null}],
        "equiroute": {"event": event, "mode": mode.name(), "from": from, "provider": to.id.0, "reason": one_line},
    });
    Bytes::from(format!(
        ": equiroute {event}: the stream of `{from}` broke ({one_line}); continued on `{}`\n\ndata: {chunk}\n\n",
        to.id
    ))
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_restart_follows_content_only_for_a_client_that_reads_restart_events() {
        use super::{
            continuation_mode,
            ResumeMode::{Off, Prefix, Restart},
        };
        // (configured, prefill, content sent, restart events) -> mode
        let table = [
            ((Off, true, false, true), None),
            ((Prefix, true, true, false), Some(Prefix)),
            ((Prefix, false, true, false), None),
            ((Prefix, false, true, true), Some(Restart)),
            ((Prefix, false, false, false), Some(Restart)),
            ((Prefix, true, false, false), Some(Restart)),
            ((Restart, true, true, true), Some(Restart)),
            ((Restart, true, true, false), Some(Prefix)),
            ((Restart, false, true, false), None),
            ((Restart, false, false, false), Some(Restart)),
        ];
        for ((mode, prefill, sent, events), want) in table {
            assert_eq!(
                continuation_mode(mode, prefill, sent, events),
                want,
                "{mode:?} prefill {prefill} sent {sent} events {events}"
            );
        }
    }

    #[test]
    fn a_prefix_is_the_text_sent_without_trailing_whitespace_as_the_last_assistant_turn() {
        let body = crate::upstream::ClientBody::from_json(
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        );
        let prefixed = super::with_assistant_prefix(&body, "Hello, wor \n").unwrap();
        assert_eq!(
            prefixed.json()["messages"][1],
            serde_json::json!({"role": "assistant", "content": "Hello, wor"})
        );
        assert!(super::with_assistant_prefix(&body, " \n").is_none());
    }
}
