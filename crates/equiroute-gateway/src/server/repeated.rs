//! Log lines a client can trigger at will, rate-limited: of each kind ([`Repeated`]) the first
//! [`BURST`] lines of a [`INTERVAL`] pass, the rest are held back, and one summary line then
//! says how many were (`… 12345 more rejected feedback ids in the last 10 s`). Every
//! occurrence is counted in `/metrics` whether its line was written or not
//! (`equiroute_log_events_total{kind}`, the held-back ones also in
//! `equiroute_log_lines_suppressed_total{kind}`), with `kind` from the fixed set below.
//!
//! Without it, 200,000 feedback calls with unknown ids wrote 25.6 MB of stderr in 35 s. The
//! request path pays an increment of the counter and one atomic add while a kind is under its
//! burst; past it, a read of the clock too. A window ends lazily, at the first line of its
//! kind after it expired, or at the gateway's periodic [`RepeatedLogs::flush`], so that a
//! burst's summary is written within two intervals even when nothing follows it.

use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lines of one kind written per interval before the rest are held back.
pub const BURST: u64 = 5;

/// The window over which [`BURST`] lines pass, and the summaries' period.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// A log line a client can make the gateway write once per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeated {
    /// `POST /v1/feedback` with an unknown or expired request id.
    FeedbackRejected,
    /// A request no provider may serve (its tenant, tools, context size, …).
    NoEligibleProvider,
    /// A provider refused the client's own request (a 4xx passed back).
    ProviderRejected,
    /// Every attempt failed (a deadline the client set too short does it at will).
    RequestFailed,
    /// A stream broke, while held or while relayed.
    StreamBroken,
    /// Every breaker open: a provider probed as a last resort.
    LastResort,
    /// The judge failed to score an answer, or its score found no request.
    JudgeFailed,
    /// The live policy detected a shift in a provider's quality scores (scores are the
    /// clients': alternating good and bad ones sets shifts off at will).
    QualityShift,
    /// A TLS handshake failed (a client of the HTTPS port that speaks plain HTTP, does not
    /// trust the certificate, or stays silent).
    TlsHandshakeFailed,
}

impl Repeated {
    /// Every kind, in the order of their windows.
    pub const ALL: [Repeated; 9] = [
        Repeated::FeedbackRejected,
        Repeated::NoEligibleProvider,
        Repeated::ProviderRejected,
        Repeated::RequestFailed,
        Repeated::StreamBroken,
        Repeated::LastResort,
        Repeated::JudgeFailed,
        Repeated::QualityShift,
        Repeated::TlsHandshakeFailed,
    ];

    /// The `kind` label in `/metrics`.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Repeated::FeedbackRejected => "feedback_rejected",
            Repeated::NoEligibleProvider => "no_eligible_provider",
            Repeated::ProviderRejected => "provider_rejected",
            Repeated::RequestFailed => "request_failed",
            Repeated::StreamBroken => "stream_broken",
            Repeated::LastResort => "last_resort",
            Repeated::JudgeFailed => "judge_failed",
            Repeated::QualityShift => "quality_shift",
            Repeated::TlsHandshakeFailed => "tls_handshake_failed",
        }
    }

    /// What the summary line counts.
    fn what(self) -> &'static str {
        match self {
            Repeated::FeedbackRejected => "rejected feedback ids (unknown or expired)",
            Repeated::NoEligibleProvider => "requests with no eligible provider",
            Repeated::ProviderRejected => "requests rejected by the provider",
            Repeated::RequestFailed => "failed requests",
            Repeated::StreamBroken => "broken streams",
            Repeated::LastResort => "last-resort probes (every breaker open)",
            Repeated::JudgeFailed => "judge failures",
            Repeated::QualityShift => "quality shifts",
            Repeated::TlsHandshakeFailed => "failed TLS handshakes",
        }
    }

    /// Whether the kind's lines (and so its summary) are at `info` rather than `warn`.
    fn informational(self) -> bool {
        matches!(self, Repeated::ProviderRejected | Repeated::LastResort)
    }
}

/// One kind's window and counters.
#[derive(Debug)]
struct Window {
    /// Lines of the kind since the window opened, written or not.
    seen: AtomicU64,
    /// Lines held back since the last summary.
    held: AtomicU64,
    /// When the window opened, in ms since [`RepeatedLogs`] started.
    opened_ms: AtomicU64,
    /// `equiroute_log_events_total{kind}`.
    events: Counter,
    /// `equiroute_log_lines_suppressed_total{kind}`.
    suppressed: Counter,
}

/// The windows of every [`Repeated`] kind.
#[derive(Debug)]
pub struct RepeatedLogs {
    started: Instant,
    windows: [Window; Repeated::ALL.len()],
}

impl RepeatedLogs {
    /// Windows counting into `metrics`' `equiroute_log_*` families.
    #[must_use]
    pub fn new(metrics: &super::metrics::Metrics) -> RepeatedLogs {
        RepeatedLogs {
            started: Instant::now(),
            windows: Repeated::ALL.map(|kind| {
                let (events, suppressed) = metrics.log_counters(kind.label());
                Window {
                    seen: AtomicU64::new(0),
                    held: AtomicU64::new(0),
                    opened_ms: AtomicU64::new(0),
                    events,
                    suppressed,
                }
            }),
        }
    }

    /// Counts one line of `kind`; whether to write it. Call it as the line's condition:
    /// `if state.logs.allow(Repeated::RequestFailed) { tracing::warn!(…) }`.
    pub fn allow(&self, kind: Repeated) -> bool {
        self.allow_at(kind, || self.elapsed_ms())
    }

    /// [`Self::allow`] with the clock, read (in ms since the start) only past the burst: then
    /// the line opens a new window if the last one expired, else it is held back.
    fn allow_at(&self, kind: Repeated, now_ms: impl FnOnce() -> u64) -> bool {
        let w = &self.windows[kind as usize];
        w.events.inc();
        if w.seen.fetch_add(1, Ordering::Relaxed) < BURST {
            return true;
        }
        if self.roll(kind, now_ms(), false).is_some() {
            w.seen.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        w.held.fetch_add(1, Ordering::Relaxed);
        w.suppressed.inc();
        false
    }

    /// Writes the summary of every kind whose window expired (`force`: of every kind with
    /// lines held back, at shutdown). The gateway calls it every [`INTERVAL`] (`state::keep_summing_up`).
    pub fn flush(&self, force: bool) {
        let now_ms = self.elapsed_ms();
        for kind in Repeated::ALL {
            self.roll(kind, now_ms, force);
        }
    }

    /// Ends `kind`'s window if it expired (or `force`), writing its summary if lines were
    /// held back; the lines held back if this call ended it (one caller wins a race).
    fn roll(&self, kind: Repeated, now_ms: u64, force: bool) -> Option<u64> {
        let w = &self.windows[kind as usize];
        let opened = w.opened_ms.load(Ordering::Relaxed);
        let interval_ms = INTERVAL.as_millis() as u64;
        if !force && now_ms < opened + interval_ms {
            return None;
        }
        w.opened_ms
            .compare_exchange(opened, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .ok()?;
        w.seen.store(0, Ordering::Relaxed);
        let held = w.held.swap(0, Ordering::Relaxed);
        if held > 0 {
            let message = summary(kind, held, now_ms.saturating_sub(opened));
            let kind_label = kind.label();
            if kind.informational() {
                tracing::info!(kind = kind_label, held, "{message}");
            } else {
                tracing::warn!(kind = kind_label, held, "{message}");
            }
        }
        Some(held)
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The line that stands for `held` lines of `kind` held back over `span_ms`.
fn summary(kind: Repeated, held: u64, span_ms: u64) -> String {
    let seconds = span_ms.div_ceil(1000);
    format!("… {held} more {} in the last {seconds} s", kind.what())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::metrics::Metrics;

    fn counter(metrics: &str, series: &str) -> u64 {
        metrics
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0, |v| v.parse().unwrap())
    }

    #[test]
    fn past_the_burst_lines_are_held_back_counted_and_summed_up_once_per_window() {
        let metrics = Metrics::default();
        let logs = RepeatedLogs::new(&metrics);
        let written = (0..10_000)
            .filter(|_| logs.allow(Repeated::FeedbackRejected))
            .count();
        assert_eq!(written as u64, BURST);
        // Another kind has a window of its own.
        assert!(logs.allow(Repeated::RequestFailed));
        // Nothing is summed up before the window ends...
        let interval_ms = INTERVAL.as_millis() as u64;
        assert_eq!(
            logs.roll(Repeated::FeedbackRejected, interval_ms - 1, false),
            None
        );
        // ...then one summary stands for the 9,995 held back, and a new window lets its
        // own burst through.
        assert_eq!(
            logs.roll(Repeated::FeedbackRejected, interval_ms, false),
            Some(9_995)
        );
        assert_eq!(
            summary(Repeated::FeedbackRejected, 9_995, interval_ms),
            "… 9995 more rejected feedback ids (unknown or expired) in the last 10 s"
        );
        let written = (0..100)
            .filter(|_| logs.allow(Repeated::FeedbackRejected))
            .count();
        assert_eq!(written as u64, BURST);
        // Every occurrence counted: 10,000 + 100, of which 9,995 + 95 held back.
        let m = metrics.render();
        assert_eq!(
            counter(
                &m,
                r#"equiroute_log_events_total{kind="feedback_rejected"}"#
            ),
            10_100
        );
        assert_eq!(
            counter(
                &m,
                r#"equiroute_log_lines_suppressed_total{kind="feedback_rejected"}"#
            ),
            10_090
        );
        assert_eq!(
            counter(&m, r#"equiroute_log_events_total{kind="request_failed"}"#),
            1
        );
    }

    #[test]
    fn a_late_line_ends_an_expired_window_and_shutdown_sums_up_what_is_left() {
        let logs = RepeatedLogs::new(&Metrics::default());
        for _ in 0..BURST + 3 {
            logs.allow(Repeated::ProviderRejected);
        }
        // Past the burst, a line after the window expired ends it and is written.
        let after = INTERVAL.as_millis() as u64;
        assert!(logs.allow_at(Repeated::ProviderRejected, || after));
        for _ in 0..BURST + 2 {
            logs.allow(Repeated::ProviderRejected);
        }
        // At shutdown, whatever the window's age: the 3 held back since.
        assert_eq!(
            logs.roll(Repeated::ProviderRejected, after + 1, true),
            Some(3)
        );
    }
}
