//! An interface's providers and its judge: `[[interfaces.NAME.providers]]` and `judge = { … }`
//! as written, checked per kind into how each upstream is reached (URLs, headers, keys, AWS
//! credentials).

use super::checks::check_name;
use super::defaults::{anthropic_defaults, AZURE_DEFAULT_API_VERSION, DEFAULT_JUDGE_PROMPT};
use super::keys;
use super::secrets::{env_secret, AwsCredentials, Secret};
use super::types::{
    AzureAuth, Caps, JudgeConfig, ProviderConfig, ProviderKind, SimSpec, UnsupportedParams,
    UpstreamConfig,
};
use equiroute_core::{Candidate, CandidateId, Capabilities, Price, ServiceTier};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
    id: String,
    kind: ProviderKind,
    model: Option<String>,
    #[serde(default)]
    tier: ServiceTier,
    #[serde(default)]
    price: Price,
    #[serde(default)]
    capabilities: RawCapabilities,
    sim: Option<SimSpec>,
    /// `openai`, `anthropic`, `gemini`: the API root, e.g. `https://api.openai.com/v1`.
    base_url: Option<String>,
    /// `azure_openai`: the resource's endpoint, e.g. `https://NAME.openai.azure.com`.
    endpoint: Option<String>,
    /// `azure_openai`: the deployment's name (default: `model`).
    deployment: Option<String>,
    /// `azure_openai`: the `api-version` query; `anthropic`: the `anthropic-version` header.
    api_version: Option<String>,
    /// `azure_openai`: `api_key` (the `api-key` header, default) or `bearer`.
    auth: Option<AzureAuth>,
    /// `anthropic`: `max_tokens` sent when the client gives none (Anthropic requires one).
    max_tokens: Option<u32>,
    /// `bedrock`: the AWS region (default: `AWS_REGION`, then `AWS_DEFAULT_REGION`).
    region: Option<String>,
    /// `http`: the endpoint to POST to.
    url: Option<String>,
    /// Name of the environment variable holding the provider's API key.
    api_key_env: Option<String>,
    /// Tenants allowed to use this provider (`x-equiroute-tenant`); absent: every tenant.
    tenants: Option<Vec<String>>,
    /// Whether the provider continues a final assistant message (default: `anthropic` only).
    assistant_prefill: Option<bool>,
    /// What the provider does with request members its API cannot express (default: the
    /// interface's).
    unsupported_params: Option<UnsupportedParams>,
    /// Most requests the provider's key takes in any 60 s (shared through Redis).
    rpm: Option<u64>,
    /// Most tokens (input and output, as the answers report them) in any 60 s.
    tpm: Option<u64>,
    /// Most requests in flight to the provider at once (per gateway instance).
    max_concurrency: Option<u64>,
    /// Among providers that tie on evidence and price, the higher goes first.
    #[serde(default)]
    preference: i32,
}

/// Capabilities as the configuration declares them: those left out take the kind's default.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCapabilities {
    tools: Option<bool>,
    json_mode: Option<bool>,
    streaming: Option<bool>,
    vision: Option<bool>,
    audio: Option<bool>,
    context_tokens: Option<u32>,
}

impl RawCapabilities {
    fn over(self, d: &Capabilities) -> Capabilities {
        Capabilities {
            tools: self.tools.unwrap_or(d.tools),
            json_mode: self.json_mode.unwrap_or(d.json_mode),
            streaming: self.streaming.unwrap_or(d.streaming),
            vision: self.vision.unwrap_or(d.vision),
            audio: self.audio.unwrap_or(d.audio),
            context_tokens: self.context_tokens.unwrap_or(d.context_tokens),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJudge {
    base_url: String,
    model: String,
    api_key_env: Option<String>,
    sample_rate: Option<f64>,
    prompt: Option<String>,
    timeout_ms: Option<f64>,
    max_in_flight: Option<usize>,
}

/// Loads an interface's providers; every one is checked, so that one run reports every
/// broken provider.
pub(super) fn load_providers(
    raw: Vec<RawProvider>,
    interface_params: Option<UnsupportedParams>,
    at: &dyn Fn(&str) -> String,
    env: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<(String, String)>,
) -> Result<Vec<ProviderConfig>, Vec<(String, String)>> {
    let mut providers = Vec::new();
    let mut problems = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    for (n, p) in raw.into_iter().enumerate() {
        let field = |f: &str| at(&format!("providers[{n}].{f}"));
        if ids.contains(&p.id) {
            problems.push((
                field("id"),
                format!("`{}` is used twice: provider ids must be unique", p.id),
            ));
            continue;
        }
        ids.push(p.id.clone());
        warnings.extend(
            ignored_fields(&p)
                .into_iter()
                .map(|(f, why)| (field(f), why)),
        );
        let unsupported_params = p
            .unsupported_params
            .or(interface_params)
            .unwrap_or_default();
        match load_provider(p, env) {
            Ok(pc) => providers.push(ProviderConfig {
                unsupported_params,
                ..pc
            }),
            Err((f, fix)) => problems.push((field(f), fix)),
        }
    }
    if problems.is_empty() {
        Ok(providers)
    } else {
        Err(problems)
    }
}

/// The fields set on a provider that its kind does not read, each with why.
fn ignored_fields(p: &RawProvider) -> Vec<(&'static str, String)> {
    use ProviderKind::{Anthropic, AzureOpenai, Bedrock, Gemini, Http, Openai, Sim};
    let kind = p.kind.name();
    [
        ("sim", p.sim.is_some(), p.kind == Sim),
        (
            "base_url",
            p.base_url.is_some(),
            matches!(p.kind, Openai | Anthropic | Gemini | Bedrock),
        ),
        ("url", p.url.is_some(), p.kind == Http),
        (
            "api_key_env",
            p.api_key_env.is_some(),
            !matches!(p.kind, Sim | Bedrock),
        ),
        ("region", p.region.is_some(), p.kind == Bedrock),
        ("endpoint", p.endpoint.is_some(), p.kind == AzureOpenai),
        ("deployment", p.deployment.is_some(), p.kind == AzureOpenai),
        ("auth", p.auth.is_some(), p.kind == AzureOpenai),
        (
            "api_version",
            p.api_version.is_some(),
            matches!(p.kind, AzureOpenai | Anthropic),
        ),
        ("max_tokens", p.max_tokens.is_some(), p.kind == Anthropic),
        (
            "assistant_prefill",
            p.assistant_prefill.is_some(),
            p.kind != Http,
        ),
        // Only the native dialects have members they cannot express.
        (
            "unsupported_params",
            p.unsupported_params.is_some(),
            matches!(p.kind, Anthropic | Gemini | Bedrock),
        ),
    ]
    .into_iter()
    .filter(|&(_, set, read)| set && !read)
    .map(|(field, _, _)| {
        (
            field,
            format!("ignored: a `{kind}` provider does not read it (remove it, or change `kind`)"),
        )
    })
    .collect()
}

/// One provider; errors carry the field below the provider and the fix.
fn load_provider(
    p: RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ProviderConfig, (&'static str, String)> {
    check_name("provider ids", &p.id).map_err(|why| ("id", why))?;
    let upstream = match p.kind {
        ProviderKind::Sim => {
            let sim = p.sim.ok_or_else(|| {
                (
                    "sim",
                    "a `sim` provider needs sim = { latency = { p50_ms, p95_ms } }".to_owned(),
                )
            })?;
            if !(sim.latency.p50_ms > 0.0 && sim.latency.p95_ms >= sim.latency.p50_ms) {
                return Err(("sim.latency", "needs 0 < p50_ms ≤ p95_ms".into()));
            }
            if !(0.0..=1.0).contains(&sim.failure_rate)
                || !(0.0..=1.0).contains(&sim.rate_limit_rate)
            {
                return Err((
                    "sim",
                    "failure_rate and rate_limit_rate must be between 0 and 1".into(),
                ));
            }
            UpstreamConfig::Sim(sim)
        }
        ProviderKind::Openai => UpstreamConfig::Openai {
            base_url: http_url(
                p.base_url.as_deref(),
                "base_url",
                "https://api.openai.com/v1",
            )?
            .trim_end_matches('/')
            .to_owned(),
            api_key: secret(p.api_key_env.as_deref(), env)?,
        },
        ProviderKind::Http => UpstreamConfig::Http {
            url: http_url(
                p.url.as_deref(),
                "url",
                "https://search.example.com/v1/search",
            )?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
        },
        ProviderKind::Anthropic
        | ProviderKind::AzureOpenai
        | ProviderKind::Gemini
        | ProviderKind::Bedrock => native_upstream(&p, env)?,
    };
    p.price.validate().map_err(|e| ("price", e.to_string()))?;
    let model = p.model.unwrap_or_else(|| p.id.clone());
    let mut candidate = Candidate::new(&p.id, &p.id, &model);
    candidate.id = CandidateId(p.id.clone());
    candidate.tier = p.tier;
    candidate.price = p.price;
    candidate.capabilities = p.capabilities.over(&p.kind.default_capabilities());
    if let Some((j, t)) = p
        .tenants
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, t)| !keys::valid_tenant(t))
    {
        return Err((
            "tenants",
            format!(
                "`{t}` (entry {j}) is not a tenant name: {}",
                keys::TENANT_FIX
            ),
        ));
    }
    candidate.tenants = p.tenants;
    candidate.preference = p.preference;
    let caps = Caps {
        rpm: at_least_one("rpm", p.rpm)?,
        tpm: at_least_one("tpm", p.tpm)?,
        max_concurrency: at_least_one("max_concurrency", p.max_concurrency)?,
    };
    Ok(ProviderConfig {
        candidate,
        upstream,
        // Anthropic's Messages continues a final assistant turn; OpenAI's chat does not.
        assistant_prefill: p
            .assistant_prefill
            .unwrap_or(p.kind == ProviderKind::Anthropic),
        // Set by the interface's loading: the provider's own, else the interface's.
        unsupported_params: UnsupportedParams::default(),
        caps,
    })
}

/// A declared cap: a whole number of at least 1 (leave it out for none).
fn at_least_one(
    field: &'static str,
    cap: Option<u64>,
) -> Result<Option<u64>, (&'static str, String)> {
    match cap {
        Some(0) => Err((
            field,
            "must be at least 1 (leave it out for no cap)".to_owned(),
        )),
        cap => Ok(cap),
    }
}

/// The upstream of a provider that speaks its host's own API (Anthropic, Azure, Gemini).
fn native_upstream(
    p: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, (&'static str, String)> {
    Ok(match p.kind {
        ProviderKind::Anthropic => UpstreamConfig::Anthropic {
            base_url: api_root(p.base_url.as_deref(), "https://api.anthropic.com/v1")?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
            version: header_text(
                p.api_version.as_deref(),
                anthropic_defaults::DEFAULT_VERSION,
            )?,
            max_tokens: match p.max_tokens {
                Some(0) => {
                    return Err((
                        "max_tokens",
                        "must be at least 1 (leave it out for 4096)".into(),
                    ))
                }
                n => n.unwrap_or(anthropic_defaults::DEFAULT_MAX_TOKENS),
            },
        },
        ProviderKind::AzureOpenai => UpstreamConfig::AzureOpenai {
            endpoint: http_url(
                p.endpoint.as_deref(),
                "endpoint",
                "https://NAME.openai.azure.com",
            )?
            .trim_end_matches('/')
            .to_owned(),
            deployment: url_segment(
                "deployment",
                p.deployment
                    .as_deref()
                    .or(p.model.as_deref())
                    .unwrap_or(&p.id),
            )?,
            api_version: url_segment(
                "api_version",
                p.api_version
                    .as_deref()
                    .unwrap_or(AZURE_DEFAULT_API_VERSION),
            )?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
            auth: p.auth.unwrap_or_default(),
        },
        ProviderKind::Gemini => {
            url_segment("model", p.model.as_deref().unwrap_or(&p.id))?;
            UpstreamConfig::Gemini {
                base_url: api_root(
                    p.base_url.as_deref(),
                    "https://generativelanguage.googleapis.com/v1beta",
                )?,
                api_key: secret(p.api_key_env.as_deref(), env)?,
            }
        }
        ProviderKind::Bedrock => bedrock_upstream(p, env)?,
        ProviderKind::Sim | ProviderKind::Openai | ProviderKind::Http => {
            return Err(("kind", "not a native dialect".into()))
        }
    })
}

/// A `bedrock` provider: its region, API root and the environment's AWS credentials.
fn bedrock_upstream(
    p: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, (&'static str, String)> {
    let model = p.model.as_deref().unwrap_or(&p.id);
    let model_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/');
    if model.is_empty() || !model.chars().all(model_ok) {
        return Err((
            "model",
            format!("`{model}` is not a Bedrock model id or ARN, e.g. anthropic.claude-sonnet-4-5-20250929-v1:0"),
        ));
    }
    let set = |name: &str| env(name).filter(|v| !v.is_empty());
    let region = match (
        p.region.as_deref(),
        set("AWS_REGION").or_else(|| set("AWS_DEFAULT_REGION")),
    ) {
        (Some(r), _) => r.to_owned(),
        (None, Some(r)) => r,
        (None, None) => {
            return Err((
                "region",
                "a `bedrock` provider needs a region: set `region = \"us-east-1\"` (or the \
                 environment variable AWS_REGION)"
                    .into(),
            ))
        }
    };
    if region.is_empty()
        || !region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err((
            "region",
            format!("`{region}` is not an AWS region, e.g. us-east-1"),
        ));
    }
    let (Some(key_id), Some(secret_key)) = (set("AWS_ACCESS_KEY_ID"), set("AWS_SECRET_ACCESS_KEY"))
    else {
        return Err((
            "kind",
            "a `bedrock` provider signs with the environment's AWS credentials: export \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary \
             credentials) before starting the gateway"
                .into(),
        ));
    };
    let default_url = format!("https://bedrock-runtime.{region}.amazonaws.com");
    Ok(UpstreamConfig::Bedrock {
        base_url: api_root(p.base_url.as_deref(), &default_url)?,
        credentials: AwsCredentials::new(&key_id, &secret_key, set("AWS_SESSION_TOKEN").as_deref()),
        region,
    })
}

pub(super) fn load_judge(
    j: RawJudge,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<JudgeConfig, (&'static str, String)> {
    let sample_rate = j.sample_rate.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_rate) {
        return Err(("sample_rate", "must be between 0 and 1".into()));
    }
    let prompt = j.prompt.unwrap_or_else(|| DEFAULT_JUDGE_PROMPT.to_owned());
    if !prompt.contains("{answer}") {
        return Err((
            "prompt",
            "must contain {answer} (and usually {question})".into(),
        ));
    }
    let timeout_ms = j.timeout_ms.unwrap_or(10_000.0);
    if !(timeout_ms.is_finite() && timeout_ms > 0.0) {
        return Err(("timeout_ms", "must be a positive number of ms".into()));
    }
    let max_in_flight = j.max_in_flight.unwrap_or(4);
    if max_in_flight == 0 {
        return Err(("max_in_flight", "must be at least 1".into()));
    }
    Ok(JudgeConfig {
        base_url: http_url(Some(&j.base_url), "base_url", "https://api.openai.com/v1")?
            .trim_end_matches('/')
            .to_owned(),
        model: j.model,
        api_key: secret(j.api_key_env.as_deref(), env)?,
        sample_rate,
        prompt,
        timeout_ms,
        max_in_flight,
    })
}

/// An API root: `url` (or the host's own, `default`) without a trailing `/`.
fn api_root(url: Option<&str>, default: &str) -> Result<String, (&'static str, String)> {
    Ok(http_url(Some(url.unwrap_or(default)), "base_url", default)?
        .trim_end_matches('/')
        .to_owned())
}

/// A name that goes into a URL's path or query as it is (a deployment, a model, a version).
fn url_segment(field: &'static str, value: &str) -> Result<String, (&'static str, String)> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@');
    if value.is_empty() || !value.chars().all(allowed) {
        return Err((
            field,
            format!("`{value}` cannot go into the provider's URL: use ASCII letters, digits, `-`, `_`, `.` and `@`"),
        ));
    }
    Ok(value.to_owned())
}

/// A value sent in a header as it is.
fn header_text(value: Option<&str>, default: &str) -> Result<String, (&'static str, String)> {
    let v = value.unwrap_or(default);
    if v.is_empty() || http::HeaderValue::from_str(v).is_err() {
        return Err((
            "api_version",
            format!("`{v}` cannot be sent as a header value, e.g. {default}"),
        ));
    }
    Ok(v.to_owned())
}

fn http_url(
    url: Option<&str>,
    field: &'static str,
    example: &str,
) -> Result<String, (&'static str, String)> {
    match url {
        Some(u)
            if (u.starts_with("http://") || u.starts_with("https://"))
                && u.parse::<http::Uri>().is_ok_and(|uri| uri.host().is_some()) =>
        {
            Ok(u.to_owned())
        }
        Some(u) => Err((
            field,
            format!("`{u}` is not an http(s) URL, e.g. {example}"),
        )),
        None => Err((
            field,
            format!("this provider kind needs `{field}`, e.g. {example}"),
        )),
    }
}

fn secret(
    name: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Secret>, (&'static str, String)> {
    let Some(n) = name else { return Ok(None) };
    let unset = "export it before starting the gateway";
    env_secret(n, "PROVIDER_API_KEY", unset, env)
        .map(Some)
        .map_err(|fix| ("api_key_env", fix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{load, load_all, no_env};

    #[test]
    fn fields_a_provider_kind_does_not_read_are_warned_about() {
        let text = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nbase_url = \"http://x/v1\"\napi_key_env = \"K\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nurl = \"http://y\"\n";
        let cfg = load(text, "x.toml", &no_env).unwrap();
        let fields: Vec<&str> = cfg.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "interfaces.chat.providers[0].base_url",
                "interfaces.chat.providers[0].api_key_env",
                "interfaces.chat.providers[1].url",
            ]
        );
        assert!(cfg.warnings[0]
            .to_string()
            .contains("a `sim` provider does not read it"));
        assert_eq!(
            cfg.interfaces[0].providers.len(),
            2,
            "warnings never drop a provider"
        );
    }

    #[test]
    fn capacity_caps_and_preference_are_read_and_a_zero_cap_names_its_field() {
        let text = |fields: &str| {
            format!(
                "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\n{fields}\n"
            )
        };
        let cfg = load(
            &text("rpm = 500\ntpm = 200000\nmax_concurrency = 8\npreference = -2"),
            "x.toml",
            &no_env,
        )
        .unwrap();
        let p = &cfg.interfaces[0].providers[0];
        assert_eq!(
            p.caps,
            Caps {
                rpm: Some(500),
                tpm: Some(200_000),
                max_concurrency: Some(8),
            }
        );
        assert_eq!(p.candidate.preference, -2);
        let plain = load(&text(""), "x.toml", &no_env).unwrap();
        assert!(!plain.interfaces[0].providers[0].caps.any());
        assert_eq!(plain.interfaces[0].providers[0].candidate.preference, 0);
        for field in ["rpm", "tpm", "max_concurrency"] {
            let e = load(&text(&format!("{field} = 0")), "x.toml", &no_env)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("providers[0].{field}")) && e.contains("at least 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn unsupported_params_is_drop_by_default_the_providers_own_wins_and_others_are_warned() {
        let text = |iface: &str| {
            format!(
                "[interfaces.chat]\nkind = \"chat\"\n{iface}\n\
                 [[interfaces.chat.providers]]\nid = \"g\"\nkind = \"gemini\"\n\
                 [[interfaces.chat.providers]]\nid = \"c\"\nkind = \"anthropic\"\nunsupported_params = \"drop\"\n\
                 [[interfaces.chat.providers]]\nid = \"o\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nunsupported_params = \"reject\"\n"
            )
        };
        let policies = |iface: &str| -> Vec<UnsupportedParams> {
            let cfg = load_all(&text(iface), "x.toml", &no_env).unwrap();
            cfg.interfaces[0]
                .providers
                .iter()
                .map(|p| p.unsupported_params)
                .collect()
        };
        let (drop, reject) = (UnsupportedParams::Drop, UnsupportedParams::Reject);
        assert_eq!(policies(""), [drop, drop, reject]);
        assert_eq!(
            policies("unsupported_params = \"reject\""),
            [reject, drop, reject]
        );
        // An OpenAI-compatible API takes every member: the setting is not read there.
        let cfg = load_all(&text(""), "x.toml", &no_env).unwrap();
        let fields: Vec<&str> = cfg.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["interfaces.chat.providers[2].unsupported_params"]);
        let e = load(&text("unsupported_params = \"ignore\""), "x.toml", &no_env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unsupported_params") && e.contains("drop"),
            "{e}"
        );
    }
}
