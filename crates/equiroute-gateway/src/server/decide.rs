//! Decide: a request numbered, featurized and sliced, its eligible providers (capabilities,
//! tenants, budgets, breakers, what each provider's API can express), their ranking by the
//! live policy or the canary's (the shadow beside it), a breaker's re-test moved to the
//! front, the hedge planned; then its [`Execution`] started. Timed for `/metrics` (the
//! router's share).

use super::error::poisoned;
use super::error::ApiError;
use super::repeated::Repeated;
use super::state::{AppState, InterfaceRuntime};
use crate::upstream::dialect::Dropped;
use axum::http::StatusCode;
use equiroute_core::eligibility::{check_eligibility, EligibilityInput};
use equiroute_core::executor::Execution;
use equiroute_core::hedge::{first_byte_outlook, hedge_plan, HedgePlan, HedgeRule, LatencyOutlook};
use equiroute_core::policies::RankContext;
use equiroute_core::policies::{Policy, Ranking};
use equiroute_core::Timestamp;
use equiroute_core::{Millis, Requirements, SlicePath, TokenEstimate};
use std::time::Instant;

/// A request after its decision, ready for its first attempt.
pub(super) struct Begun {
    pub(super) n: u64,
    pub(super) request_id: String,
    pub(super) started: Instant,
    pub(super) features: Vec<f64>,
    pub(super) tokens: TokenEstimate,
    pub(super) decided: Decided,
    pub(super) run: Execution,
}

/// Numbers the request, sizes and featurizes it, decides, and starts its execution.
pub(super) fn begin(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: &super::RequestMeta,
) -> Result<Begun, ApiError> {
    let (n, request_id) = state.next_request();
    tracing::Span::current().record("request_id", request_id.as_str());
    let started = Instant::now();
    let features = iface
        .featurizer
        .featurize(&super::query_text(iface.kind, body));
    let t0 = state.at(started);
    let (requirements, tokens) = super::request_profile(iface.kind, body);
    let span = super::spans::decision();
    let decided = span
        .in_scope(|| {
            decide(
                state,
                iface,
                body,
                &features,
                n,
                pinned,
                deadline,
                t0,
                &requirements,
                tokens,
                meta,
            )
        })
        .map_err(|e| {
            span.record("otel.status_code", "ERROR");
            if state.logs.allow(Repeated::NoEligibleProvider) {
                tracing::warn!(request_id = %request_id, error = %e.message, "no eligible provider");
            }
            e.for_request(&request_id, 0)
        })?;
    super::spans::record_decision(
        &span,
        iface,
        &super::spans::DecisionView {
            policy: decided.routed.policy,
            eligible: &decided.eligible,
            excluded: &decided.excluded,
            ranking: &decided.ranking,
            last_resort: decided.last_resort,
            hedge_delay: decided.hedge.map(|h| h.delay.0),
        },
    );
    drop(span);
    if tracing::enabled!(tracing::Level::DEBUG) {
        let id = |i: &usize| iface.candidates[*i].id.0.as_str();
        tracing::debug!(
            chosen = decided.order.first().map(id),
            candidates = ?decided.order.iter().map(id).collect::<Vec<_>>(),
            excluded = decided.excluded.len(),
            propensity = decided.ranking.first_choice_probability(),
            "decided"
        );
    }
    // Where a 5xx retry's pause falls in its jitter range, from the request's seed.
    let jitter = (state.seed_for(n).rotate_left(29) >> 11) as f64 / (1u64 << 53) as f64;
    let run = Execution::new(decided.order.clone(), t0, deadline, iface.limits)
        .with_jitter(jitter)
        .with_interchangeable(decided.ranking.interchangeable)
        .with_hedge(
            decided
                .hedge
                .filter(|_| iface.hedge.streams || !body_streams(body)),
        );
    Ok(Begun {
        n,
        request_id,
        started,
        features,
        tokens,
        decided,
        run,
    })
}

/// What was decided for a request, kept for the audit log.
pub(super) struct Decided {
    /// When the request was decided.
    pub(super) at: equiroute_core::Timestamp,
    /// The eligible candidates, in configuration order.
    pub(super) eligible: Vec<usize>,
    pub(super) deadline: Option<Millis>,
    pub(super) tokens: TokenEstimate,
    pub(super) order: Vec<usize>,
    /// The statistics slice of the request.
    pub(super) slice: SlicePath,
    /// Which arm (live or canary) ranked it.
    pub(super) routed: super::arms::Routed,
    pub(super) ranking: equiroute_core::policies::Ranking,
    pub(super) excluded: Vec<equiroute_core::eligibility::Exclusion>,
    /// Every usable provider's breaker was open: the first is probed as a last resort.
    pub(super) last_resort: bool,
    /// The first in `order` was moved there, ahead of the policy's choice, for a re-test its
    /// breaker asked for ([`retested_order`]).
    pub(super) retest: bool,
    /// Each streamed attempt's first-byte limit in ms (streamed requests only).
    pub(super) first_byte_limits: Vec<FirstByteLimitRecord>,
    /// When the first attempt gets a hedge and why (`None`: no hedge), from the policy's
    /// beliefs.
    pub(super) hedge: Option<equiroute_core::hedge::HedgePlan>,
    /// The attempts (by number) that continued a broken stream, and how (`stream_resume`).
    pub(super) continuations: Vec<(usize, &'static str)>,
    /// What each candidate's API drops from the request (`unsupported_params = "drop"`).
    pub(super) dropped: Vec<Dropped>,
}

/// The ranking's order with the first provider whose breaker says it is due a re-test moved
/// to the front ([`equiroute_core::breaker::retested_order`], which also drops the ranking's
/// claim that its head is interchangeable): a provider that failed is tried again whatever
/// its rank, the others staying its fallbacks. Whether one moved.
pub(super) fn retested_order(
    iface: &InterfaceRuntime,
    ranking: &mut equiroute_core::policies::Ranking,
    now: equiroute_core::Timestamp,
) -> Result<(Vec<usize>, bool), ApiError> {
    let breakers = iface.breakers.lock().map_err(|_| poisoned())?;
    Ok(equiroute_core::breaker::retested_order(
        ranking,
        &breakers,
        now,
        &iface.breaker_config,
    ))
}

/// Moves the eligible providers whose API cannot express `body` to the exclusions: the request
/// is passed over to a provider that can. Returns what each candidate's API drops from `body`
/// (`unsupported_params = "drop"`), by candidate.
pub(super) fn exclude_inexpressible(
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    eligible: &mut equiroute_core::eligibility::Eligible,
) -> Vec<Dropped> {
    use equiroute_core::eligibility::{Exclusion, ExclusionReason};
    let mut dropped = vec![Dropped::default(); iface.candidates.len()];
    let excluded = &mut eligible.excluded;
    eligible.eligible.retain(
        |&i| match iface.upstreams[i].expressible(iface.kind, body) {
            Ok(d) => {
                dropped[i] = d;
                true
            }
            Err(refusal) => {
                excluded.push(Exclusion {
                    candidate: i,
                    reason: ExclusionReason::Inexpressible {
                        field: refusal.field,
                        why: refusal.why,
                    },
                });
                false
            }
        },
    );
    dropped
}

/// The answer when no provider is left: the caller's 4xx ([`super::unservable`]) when the request itself shut every
/// one out, else 503 `no_eligible_provider` with each exclusion's reason.
pub(super) fn no_eligible(
    state: &AppState,
    iface: &InterfaceRuntime,
    excluded: &[equiroute_core::eligibility::Exclusion],
    (body, tokens): (&serde_json::Value, TokenEstimate),
    now: equiroute_core::Timestamp,
) -> ApiError {
    let ids = |i: usize| iface.candidates[i].id.to_string();
    if let Some(e) = super::unservable::answer(&iface.name, &ids, excluded, body, tokens) {
        iface.meters.request(&state.metrics, "client_error");
        return e;
    }
    iface.meters.request(&state.metrics, "no_eligible_provider");
    let reasons: Vec<String> = excluded
        .iter()
        // A reason may quote the client's tenant header: cut like any echoed input.
        .map(|e| {
            let reason = e.reason.to_string();
            format!(
                "{}: {}",
                iface.candidates[e.candidate].id,
                super::error::echo(&reason)
            )
        })
        .collect();
    ApiError {
        retry_after_s: breaker_retry_after(excluded, now),
        ..ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_eligible_provider",
            format!(
                "no provider of `{}` can take this request ({})",
                iface.name,
                reasons.join("; ")
            ),
        )
    }
}

/// Streamed requests hedge only with `hedge.streams` (a race to the first byte).
pub(super) fn body_streams(body: &serde_json::Value) -> bool {
    body.get("stream").and_then(serde_json::Value::as_bool) == Some(true)
}

/// Eligibility then ranking: the router's share of the request, timed for `/metrics`.
#[allow(clippy::too_many_arguments)]
pub(super) fn decide(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    features: &[f64],
    n: u64,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    now: equiroute_core::Timestamp,
    requirements: &Requirements,
    tokens: TokenEstimate,
    meta: &super::RequestMeta,
) -> Result<Decided, ApiError> {
    let started = Instant::now();
    let slice = SlicePath::from_parts(
        meta.task_class.as_deref(),
        Some(equiroute_core::deadline_class(deadline)),
        requirements.streaming,
        Some(equiroute_core::input_size_bucket(tokens.input)),
        SlicePath::MAX_DEPTH,
    );
    let (eligible, last_resort, mut dropped) = {
        let mut breakers = iface.breakers.lock().map_err(|_| poisoned())?;
        let mut input = EligibilityInput::new(&iface.candidates, requirements);
        input.breakers = Some((&breakers, &iface.breaker_config));
        input.pinned = pinned;
        input.tenant = meta.tenant.as_deref();
        input.tokens = tokens;
        input.now = now;
        let mut eligible = check_eligibility(&input);
        let dropped = exclude_inexpressible(iface, body, &mut eligible);
        // Every usable provider shut out by failures: probe the one reopening soonest now
        // rather than refuse the request (see `equiroute_core::breaker`).
        let last_resort = eligible.last_resort(&breakers, &iface.breaker_config);
        if let Some(i) = last_resort {
            if let Some(t) = breakers[i].last_resort() {
                state.metrics.breaker(
                    &iface.name,
                    &iface.candidates[i].id.0,
                    super::metrics::transition_name(t),
                );
            }
            state.metrics.last_resort(&iface.name);
            if state.logs.allow(Repeated::LastResort) {
                tracing::info!(provider = %iface.candidates[i].id, "every provider's breaker is open: probing the one that reopens soonest as a last resort");
            }
            eligible.excluded.retain(|e| e.candidate != i);
            eligible.eligible.push(i);
        }
        (eligible, last_resort, dropped)
    };
    // A last resort was shut out before its API was asked.
    if let Some(i) = last_resort {
        dropped[i] = iface.upstreams[i]
            .expressible(iface.kind, body)
            .unwrap_or_default();
    }
    if eligible.eligible.is_empty() {
        return Err(no_eligible(
            state,
            iface,
            &eligible.excluded,
            (body, tokens),
            now,
        ));
    }
    let (mut ranking, routed, hedge) = {
        let mut ctx = RankContext::new(&iface.candidates, &eligible.eligible, features);
        ctx.deadline = deadline;
        ctx.tokens = tokens;
        ctx.slice = slice;
        ctx.now = now;
        // The live policy, or the canary's for its share; the shadow ranks beside it.
        let (ranking, routed) =
            super::arms::rank(iface, &ctx, meta.session.as_deref(), state.seed_for(n), n)
                .map_err(|_| poisoned())?;
        // Hedges are planned from the live policy's beliefs (canary requests do not hedge);
        // without hedging the policy is not read a second time.
        let delay = if routed.arm == super::arms::Arm::Live && iface.hedge.active() {
            let policy = iface.policy.read().map_err(|_| poisoned())?;
            let streamed = iface.hedge.streams && body_streams(body);
            hedge_delay(iface, policy.as_ref(), &ctx, &ranking, streamed)
        } else {
            None
        };
        (ranking, routed, delay)
    };
    state
        .metrics
        .decision_time(started.elapsed().as_secs_f64() * 1e6);
    let (order, retest) = retested_order(iface, &mut ranking, now)?;
    if let Some(&first) = order.first() {
        iface.first_choices[first].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Decided {
        at: now,
        eligible: eligible.eligible,
        deadline,
        tokens,
        order,
        slice,
        routed,
        ranking,
        last_resort: last_resort.is_some(),
        retest,
        excluded: eligible.excluded,
        dropped,
        first_byte_limits: Vec::new(),
        // The plan is the policy's first choice's: not the re-tested provider's.
        hedge: hedge.filter(|_| !retest),
        continuations: Vec::new(),
    })
}

/// When a request that found no eligible provider may be retried: the seconds (rounded up,
/// at least 1) until the earliest open breaker half-opens; 1 when a breaker is half-open with
/// its probes in flight (they settle it soon). `None` when no breaker excluded anyone: the
/// request itself does not fit, and waiting will not change that.
pub(super) fn breaker_retry_after(
    excluded: &[equiroute_core::eligibility::Exclusion],
    now: equiroute_core::Timestamp,
) -> Option<u16> {
    excluded
        .iter()
        .filter_map(|e| match e.reason {
            equiroute_core::eligibility::ExclusionReason::CircuitOpen { until } => {
                let wait_ms = until.map_or(0.0, |t| (t.0 - now.0).max(0.0));
                // Saturating float-to-int cast (18 hours at most); the ceiling of the wait.
                Some(((wait_ms / 1000.0).ceil() as u16).max(1))
            }
            _ => None,
        })
        .min()
}

/// A streamed attempt's first-byte limit, as the audit record shows it: the attempt's
/// candidate, when it started, and the limit in ms.
pub(super) type FirstByteLimitRecord = (usize, equiroute_core::Timestamp, Option<f64>);

/// The hedge delay of a request just ranked, and the part of the rule that set it, when the
/// interface hedges. A `streamed` request
/// (on an interface whose streams hedge) races to the first byte, so it is planned on
/// first-byte beliefs once the first candidate has one ([`first_byte_outlooks`]), unless
/// `first_byte.plan_hedges` is off.
pub(super) fn hedge_delay(
    iface: &InterfaceRuntime,
    policy: &dyn Policy,
    ctx: &RankContext<'_>,
    ranking: &Ranking,
    streamed: bool,
) -> Option<HedgePlan> {
    if !iface.hedge.active() {
        return None;
    }
    // Every request earns its share of a hedge, whether it hedges or not; the price of a
    // hedge (for the priced rule) is read before this request moves it.
    let mut price = equiroute_core::hedge::HedgeBudget::INITIAL_PRICE;
    if let Ok(mut budget) = iface.hedge_budget.lock() {
        price = budget.price();
        budget.earn();
    }
    // The observed-quantile rule is the laboratory's baseline; config refuses it here.
    if matches!(iface.hedge.rule, HedgeRule::ObservedQuantile { .. }) {
        return None;
    }
    let mut order = ranking.indices();
    let (a, b) = (order.next()?, order.next());
    let mut first = policy.latency_outlook(a, ctx);
    let mut target = b.and_then(|j| policy.latency_outlook(j, ctx));
    if streamed && iface.first_byte.plan_hedges {
        (first, target) = first_byte_outlooks(iface, ctx.now, (a, b), (first, target));
    }
    hedge_plan(
        iface.hedge.rule,
        first.as_ref(),
        target.as_ref(),
        None,
        ctx.deadline,
        price,
    )
}

/// The outlooks of a streamed request's first candidate `a` and hedge target `b`: once `a`
/// has a first-byte belief (`first_byte.min_observations` first bytes seen), first-byte
/// beliefs in place of whole-answer latencies (failure rates kept), the target's whole-answer
/// outlook standing in for a first-byte belief it has not got yet (its first byte comes no
/// later than its answer: the stand-in only hedges later); before that, the outlooks as given.
pub(super) fn first_byte_outlooks(
    iface: &InterfaceRuntime,
    now: Timestamp,
    (a, b): (usize, Option<usize>),
    (first, target): (Option<LatencyOutlook>, Option<LatencyOutlook>),
) -> (Option<LatencyOutlook>, Option<LatencyOutlook>) {
    let Ok(stats) = iface.first_bytes.lock() else {
        return (first, target);
    };
    let belief = |i: usize| stats.get(i).and_then(|s| iface.first_byte.belief(s, now));
    let Some(first_byte) = belief(a) else {
        return (first, target);
    };
    (
        first_byte_outlook(first.as_ref(), Some(first_byte)),
        first_byte_outlook(target.as_ref(), b.and_then(belief)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use equiroute_core::eligibility::{Exclusion, ExclusionReason};
    use equiroute_core::Timestamp;

    #[test]
    fn retry_after_is_the_wait_to_the_earliest_half_open_rounded_up() {
        let open = |candidate, until: Option<f64>| Exclusion {
            candidate,
            reason: ExclusionReason::CircuitOpen {
                until: until.map(Timestamp),
            },
        };
        let now = Timestamp(1_000.0);
        // 29.001 s and 45 s away: the earlier, rounded up to 30.
        let excluded = [open(0, Some(30_001.0)), open(1, Some(46_000.0))];
        assert_eq!(breaker_retry_after(&excluded, now), Some(30));
        // Already due, or half-open with its probes in flight: soon, 1 s.
        assert_eq!(breaker_retry_after(&[open(0, Some(900.0))], now), Some(1));
        assert_eq!(breaker_retry_after(&[open(0, None)], now), Some(1));
        // Excluded for what the request needs: waiting changes nothing.
        let unfit = Exclusion {
            candidate: 0,
            reason: ExclusionReason::MissingCapability {
                capability: "tools".into(),
            },
        };
        assert_eq!(breaker_retry_after(&[unfit], now), None);
    }
}
