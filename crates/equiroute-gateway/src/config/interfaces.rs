//! One `[interfaces.NAME]` table: its raw fields and their checks into an
//! [`InterfaceConfig`] (policies, limits and retries, hedging, streams, breaker, task classes),
//! its providers and judge loaded by `providers`.

use super::checks::{check_name, check_task_classes, refuse_laboratory_policies};
use super::defaults::MAX_CONNECTION_TIMEOUT_MS;
use super::first_byte;
use super::providers::{load_judge, load_providers, RawJudge, RawProvider};
use super::rollout::{self, RolloutConfig};
use super::types::{InterfaceConfig, InterfaceKind, ProviderConfig, UnsupportedParams};
use equiroute_core::breaker::BreakerConfig;
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::policies::PolicyConfig;
use equiroute_core::{Candidate, Millis};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawInterface {
    kind: InterfaceKind,
    #[serde(default)]
    policy: Option<PolicyConfig>,
    /// An exploration floor: every eligible provider keeps at least this probability of
    /// going first, so that the audit log supports evaluating other policies.
    min_propensity: Option<f64>,
    deadline_ms: Option<f64>,
    max_attempts: Option<u32>,
    attempt_timeout_ms: Option<f64>,
    /// Longest silence between chunks of a streamed answer before it is ended as broken.
    stream_idle_ms: Option<f64>,
    /// When a provider error retries the same provider instead of falling over.
    retry: Option<RawRetry>,
    /// How a streamed attempt's first-byte limit is learnt from the provider.
    first_byte: Option<first_byte::FirstByteLimit>,
    /// How much of a stream is held back so that an early failure can fall back.
    stream_hold: Option<first_byte::StreamHold>,
    /// Whether a stream that breaks after it was committed goes on elsewhere.
    stream_resume: Option<first_byte::StreamResume>,
    /// An LLM-as-judge that scores a sample of answers.
    judge: Option<RawJudge>,
    feature_dim: Option<usize>,
    /// Words of a request's text that are hashed into its features.
    feature_max_words: Option<usize>,
    /// Thresholds of every provider's circuit breaker; fields left out keep their defaults.
    breaker: Option<BreakerConfig>,
    /// Task classes (`x-equiroute-task-class`) learnt in slices of their own; absent: any.
    task_classes: Option<Vec<String>>,
    /// A policy that ranks every request beside the live one, learns, and never acts.
    shadow: Option<PolicyConfig>,
    /// A candidate policy on a share of the requests, rolled back automatically.
    rollout: Option<rollout::RawRollout>,
    /// Hedged requests (docs/hedging.md); absent: off.
    hedge: Option<RawHedge>,
    /// What its providers do with request members their API cannot express (default `drop`).
    unsupported_params: Option<UnsupportedParams>,
    #[serde(default)]
    providers: Vec<RawProvider>,
}

/// `hedge = { … }` on an interface; absent fields keep their defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHedge {
    enabled: Option<bool>,
    rule: Option<equiroute_core::hedge::HedgeRule>,
    max_rate: Option<f64>,
    burst: Option<f64>,
    max_parallel: Option<u32>,
    streams: Option<bool>,
    /// Whether a call may safely run twice; tool interfaces hedge only when it is set.
    idempotent: Option<bool>,
}

/// An interface's hedging, or the problem as (field, fix).
fn hedge_config(
    raw: Option<&RawHedge>,
    kind: InterfaceKind,
) -> Result<equiroute_core::hedge::HedgeConfig, (String, String)> {
    // The gateway races streams only when asked (`streams = true`).
    let d = equiroute_core::hedge::HedgeConfig {
        streams: false,
        ..equiroute_core::hedge::HedgeConfig::default()
    };
    let Some(raw) = raw else { return Ok(d) };
    let cfg = equiroute_core::hedge::HedgeConfig {
        enabled: raw.enabled.unwrap_or(true),
        rule: raw.rule.unwrap_or(d.rule),
        max_rate: raw.max_rate.unwrap_or(d.max_rate),
        burst: raw.burst.unwrap_or(d.burst),
        max_parallel: raw.max_parallel.unwrap_or(d.max_parallel),
        streams: raw.streams.unwrap_or(d.streams),
    };
    cfg.validate().map_err(|e| match e {
        equiroute_core::ConfigError::OutOfRange { field, value, fix } => {
            (field.to_owned(), format!("{value}: {fix}"))
        }
        other => ("hedge".to_owned(), other.to_string()),
    })?;
    if cfg.enabled
        && matches!(
            cfg.rule,
            equiroute_core::hedge::HedgeRule::ObservedQuantile { .. }
        )
    {
        return Err((
            "hedge.rule".to_owned(),
            "`observed-quantile` is the laboratory's fixed-delay baseline: use `{ kind = \"priced-saving\" }` (default), `{ kind = \"deadline-risk\" }` or `{ kind = \"predictive-quantile\" }`".to_owned(),
        ));
    }
    // A tool call may act (send, write, pay): only one marked idempotent is sent twice.
    if cfg.enabled && kind == InterfaceKind::Tool && raw.idempotent != Some(true) {
        return Err((
            "hedge.idempotent".to_owned(),
            "a tool interface hedges only when its calls are safe to run twice: set `idempotent = true`, or `enabled = false`".to_owned(),
        ));
    }
    Ok(cfg)
}

/// The retry rule's knobs (`retry = { … }` on an interface); absent fields keep their
/// defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    /// Longest `Retry-After` waited out on the best-ranked provider (0: never wait).
    max_retry_after_wait_ms: Option<f64>,
    /// Whether a 5xx without `Retry-After` is retried once on the same provider.
    server_error: Option<bool>,
    /// Mean pause before that retry.
    server_error_pause_ms: Option<f64>,
    /// Spread of the pause around its mean, a fraction in [0, 1].
    jitter: Option<f64>,
}

/// An interface's limits on its attempts, or the problem as (field, fix).
fn execution_limits(
    max_attempts: Option<u32>,
    attempt_timeout_ms: Option<f64>,
    retry: Option<&RawRetry>,
) -> Result<ExecutionLimits, (String, String)> {
    let max_attempts = max_attempts.unwrap_or(3);
    if max_attempts == 0 {
        return Err(("max_attempts".into(), "must be at least 1".into()));
    }
    // Never wait forever on one provider, even without a deadline.
    let attempt_timeout = match attempt_timeout_ms {
        Some(t) if t.is_finite() && t > 0.0 => Millis(t),
        Some(_) => {
            return Err((
                "attempt_timeout_ms".into(),
                "must be a positive number of ms".into(),
            ))
        }
        None => Millis(60_000.0),
    };
    let limits = ExecutionLimits {
        max_attempts,
        attempt_timeout: Some(attempt_timeout),
        ..ExecutionLimits::default()
    };
    match retry {
        Some(retry) => retry_limits(retry, limits),
        None => Ok(limits),
    }
}

/// The execution limits of an interface's retry knobs, or the problem as (field, fix).
fn retry_limits(
    raw: &RawRetry,
    limits: ExecutionLimits,
) -> Result<ExecutionLimits, (String, String)> {
    let ms = |v: Option<f64>, field: &str, default: Millis| match v {
        None => Ok(default),
        Some(t) if t.is_finite() && (0.0..=MAX_CONNECTION_TIMEOUT_MS).contains(&t) => Ok(Millis(t)),
        Some(t) => Err((
            format!("retry.{field}"),
            format!(
                "`{t}` is not a wait: write milliseconds from 0 to 86400000 (default {})",
                default.0
            ),
        )),
    };
    let defaults = ExecutionLimits::default();
    let max_retry_after_wait = ms(
        raw.max_retry_after_wait_ms,
        "max_retry_after_wait_ms",
        defaults.max_retry_after_wait,
    )?;
    let pause = ms(
        raw.server_error_pause_ms,
        "server_error_pause_ms",
        defaults.server_error_retry.unwrap_or(Millis(50.0)),
    )?;
    let jitter = raw.jitter.unwrap_or(defaults.server_error_jitter);
    if !(0.0..=1.0).contains(&jitter) {
        return Err((
            "retry.jitter".into(),
            format!(
                "must be a fraction from 0 to 1 (default {}), got {jitter}",
                defaults.server_error_jitter
            ),
        ));
    }
    Ok(ExecutionLimits {
        max_retry_after_wait,
        server_error_retry: raw.server_error.unwrap_or(true).then_some(pause),
        server_error_jitter: jitter,
        ..limits
    })
}

/// One interface; errors carry the field path and the fix. Fields that are set but not read
/// go to `warnings`, with their path and why.
pub(super) fn load_interface(
    name: &str,
    raw: RawInterface,
    env: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<(String, String)>,
) -> Result<InterfaceConfig, Vec<(String, String)>> {
    let at = |f: &str| format!("interfaces.{name}.{f}");
    if let Err(why) = check_name("interface names", name) {
        return Err(vec![(format!("interfaces.{name}"), why)]);
    }
    if raw.providers.is_empty() {
        return Err(vec![(
            at("providers"),
            "add at least one [[interfaces.NAME.providers]] entry".into(),
        )]);
    }
    let providers = load_providers(raw.providers, raw.unsupported_params, &at, env, warnings)?;
    let feature_dim = raw.feature_dim.unwrap_or(64);
    let feature_max_words = raw
        .feature_max_words
        .unwrap_or(equiroute_core::prelude::Featurizer::DEFAULT_MAX_WORDS);
    equiroute_core::prelude::Featurizer::check_max_words(feature_max_words)
        .map_err(|e| vec![(at("feature_max_words"), e.to_string())])?;
    let policies = (raw.policy.as_ref(), raw.shadow.as_ref(), raw.rollout);
    let (policy, rollout) =
        load_policies(policies, &providers, feature_dim).map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let exploration_floor =
        exploration_floor(raw.min_propensity).map_err(|fix| vec![(at("min_propensity"), fix)])?;
    let positive = |v: Option<f64>, field: &str| -> Result<Option<Millis>, Vec<(String, String)>> {
        match v {
            Some(t) if t.is_finite() && t > 0.0 => Ok(Some(Millis(t))),
            Some(_) => Err(vec![(at(field), "must be a positive number of ms".into())]),
            None => Ok(None),
        }
    };
    let deadline = positive(raw.deadline_ms, "deadline_ms")?;
    let stream_idle = positive(raw.stream_idle_ms, "stream_idle_ms")?.unwrap_or(Millis(30_000.0));
    let limits = execution_limits(raw.max_attempts, raw.attempt_timeout_ms, raw.retry.as_ref())
        .map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let first_byte = raw.first_byte.unwrap_or_default();
    first_byte
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("first_byte.{f}")), fix)])?;
    let stream_hold = raw.stream_hold.unwrap_or_default();
    stream_hold
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("stream_hold.{f}")), fix)])?;
    let stream_resume = raw.stream_resume.unwrap_or_default();
    stream_resume
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("stream_resume.{f}")), fix)])?;
    let hedge =
        hedge_config(raw.hedge.as_ref(), raw.kind).map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let breaker = raw.breaker.unwrap_or_default();
    breaker
        .validate()
        .map_err(|e| vec![(at("breaker"), e.to_string())])?;
    if let Some(classes) = &raw.task_classes {
        check_task_classes(classes)
            .map_err(|(n, why)| vec![(at(&format!("task_classes[{n}]")), why)])?;
    }
    let judge = match raw.judge {
        None => None,
        Some(j) => {
            Some(load_judge(j, env).map_err(|(f, fix)| vec![(at(&format!("judge.{f}")), fix)])?)
        }
    };
    Ok(InterfaceConfig {
        name: name.to_owned(),
        exploration_floor,
        stream_idle,
        first_byte,
        stream_hold,
        stream_resume,
        judge,
        kind: raw.kind,
        policy,
        deadline,
        limits,
        hedge,
        feature_dim,
        feature_max_words,
        breaker,
        task_classes: raw.task_classes,
        shadow: raw.shadow,
        rollout,
        providers,
    })
}

/// An interface's `min_propensity` as an exploration floor (inactive when absent), or the fix.
fn exploration_floor(
    min_propensity: Option<f64>,
) -> Result<equiroute_core::policies::ExplorationFloorConfig, String> {
    let floor = equiroute_core::policies::ExplorationFloorConfig {
        min_propensity: min_propensity.unwrap_or(0.0),
        ..equiroute_core::policies::ExplorationFloorConfig::default()
    };
    floor
        .validate()
        .map_err(|e| format!("{e} (e.g. 0.01: each provider first on at least 1% of requests)"))?;
    Ok(floor)
}

/// An interface's `policy` (`lqm-ts` by default), `shadow` and `rollout`: the policy built
/// against the providers, the shadow checked, the rollout validated; the error is (field under the interface, fix).
fn load_policies(
    (policy, shadow, rollout): (
        Option<&PolicyConfig>,
        Option<&PolicyConfig>,
        Option<rollout::RawRollout>,
    ),
    providers: &[ProviderConfig],
    feature_dim: usize,
) -> Result<(PolicyConfig, Option<RolloutConfig>), (String, String)> {
    let candidates: Vec<Candidate> = providers.iter().map(|p| p.candidate.clone()).collect();
    let candidates = &candidates[..];
    let policy = policy
        .cloned()
        .unwrap_or_else(|| PolicyConfig::default_for(equiroute_core::policies::PolicyKind::LqmTs));
    refuse_laboratory_policies(&policy).map_err(|fix| ("policy".to_owned(), fix))?;
    policy
        .build(candidates, feature_dim)
        .map_err(|e| ("policy".to_owned(), e.to_string()))?;
    let rollout = rollout::side_policies(shadow, rollout, candidates, feature_dim)?;
    Ok((policy, rollout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{load, no_env};

    #[test]
    fn min_propensity_wraps_the_policy_in_an_exploration_floor_and_a_bad_one_is_named() {
        let text = |floor: &str| {
            format!("[interfaces.chat]\nkind = \"chat\"\npolicy = \"lqm\"\n{floor}[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n")
        };
        let off = load(&text(""), "x.toml", &no_env).unwrap();
        assert!(!off.interfaces[0].exploration_floor.is_active());
        let on = load(&text("min_propensity = 0.05\n"), "x.toml", &no_env).unwrap();
        assert!((on.interfaces[0].exploration_floor.min_propensity - 0.05).abs() < 1e-12);
        let e = load(&text("min_propensity = 0.7\n"), "x.toml", &no_env).unwrap_err();
        assert_eq!(e.field, "interfaces.chat.min_propensity");
        assert!(e.fix.contains("e.g. 0.01"), "{e}");
    }

    #[test]
    fn a_stream_hold_out_of_range_names_its_field_and_the_fix() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nHOLD\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let with = |hold: &str| load(&base.replace("HOLD", hold), "x.toml", &no_env);
        // By default only what precedes the first content is held (no timed hold).
        let default = with("").unwrap().interfaces[0].stream_hold;
        assert!(default.is_on() && default.until_content && !default.is_timed());
        let off = with("stream_hold = { until_content = false }").unwrap();
        assert!(!off.interfaces[0].stream_hold.is_on());
        let on = with("stream_hold = { ms = 800, events = 20 }").unwrap();
        assert_eq!(
            on.interfaces[0].stream_hold,
            first_byte::StreamHold {
                ms: 800.0,
                events: 20,
                until_content: true
            }
        );
        for (hold, field) in [
            (
                "stream_hold = { ms = -1 }",
                "interfaces.chat.stream_hold.ms",
            ),
            (
                "stream_hold = { ms = 60001 }",
                "interfaces.chat.stream_hold.ms",
            ),
            (
                "stream_hold = { events = 100001 }",
                "interfaces.chat.stream_hold.events",
            ),
        ] {
            let e = with(hold).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("must be"), "{hold}: {e}");
        }
    }

    #[test]
    fn stream_resume_is_prefix_by_default_and_its_fields_are_checked_by_name() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nRESUME\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"anthropic\"\n[[interfaces.chat.providers]]\nid = \"c\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nassistant_prefill = true\n";
        let with = |r: &str| load(&base.replace("RESUME", r), "x.toml", &no_env);
        let off = with("").unwrap();
        assert_eq!(
            off.interfaces[0].stream_resume.mode,
            first_byte::ResumeMode::Prefix,
            "prefix by default"
        );
        assert!(!with("stream_resume = { mode = \"off\" }")
            .unwrap()
            .interfaces[0]
            .stream_resume
            .is_on());
        // Prefill: Anthropic's by default, anyone's when declared.
        let prefill: Vec<bool> = off.interfaces[0]
            .providers
            .iter()
            .map(|p| p.assistant_prefill)
            .collect();
        assert_eq!(prefill, [false, true, true]);
        let on = with("stream_resume = { mode = \"prefix\", max = 2 }").unwrap();
        assert_eq!(
            on.interfaces[0].stream_resume,
            first_byte::StreamResume {
                mode: first_byte::ResumeMode::Prefix,
                max: 2,
                max_kept_bytes: 64 * 1024
            }
        );
        for (resume, field, fix) in [
            (
                "stream_resume = { mode = \"prefix\", max = 0 }",
                "interfaces.chat.stream_resume.max",
                "must be from 1",
            ),
            (
                "stream_resume = { mode = \"restart\", max_kept_bytes = 0 }",
                "interfaces.chat.stream_resume.max_kept_bytes",
                "must be from 1",
            ),
            (
                "stream_resume = { mode = \"continue\" }",
                "interfaces.chat.stream_resume.mode",
                "unknown variant",
            ),
        ] {
            let e = with(resume).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(fix), "{resume}: {e}");
        }
    }

    #[test]
    fn a_policy_is_a_name_or_a_table_and_oracle_is_refused() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nPOLICY\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let with = |policy: &str| load(&base.replace("POLICY", policy), "x.toml", &no_env);
        // The name alone is the policy with its defaults, as the table with only a name.
        let by_name = with("policy = \"lqm\"").map(|c| c.interfaces[0].policy.clone());
        let by_table = with("policy = { name = \"lqm\" }").map(|c| c.interfaces[0].policy.clone());
        assert_eq!(by_name, by_table);
        assert_eq!(
            by_name.map(|p| p.kind()),
            Ok(equiroute_core::policies::PolicyKind::Lqm)
        );
        // Errors name the policy field and the valid shapes, never serde's internal names.
        for (policy, says) in [
            ("policy = \"lqmx\"", "lqm-ts"),
            ("policy = 3", "a name such as"),
            ("policy = { l_ref_ms = 800 }", "has no `name`"),
            ("policy = { name = \"lqm\", l_ref = 800 }", "l_ref"),
            ("policy = \"oracle\"", "only in the laboratory"),
            ("policy = { name = \"oracle\" }", "only in the laboratory"),
        ] {
            let e = with(policy).unwrap_err();
            let text = e.to_string();
            assert!(
                e.field.starts_with("interfaces.chat.policy"),
                "{policy}: {e}"
            );
            assert!(text.contains(says), "{policy}: {e}");
            assert!(
                !text.contains("PolicyConfig") && !text.contains("internally tagged"),
                "{policy}: {e}"
            );
        }
    }
}
