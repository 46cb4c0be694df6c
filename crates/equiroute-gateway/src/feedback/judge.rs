//! LLM-as-judge: an OpenAI-compatible model scores a sample of answers in [0, 1].

use crate::config::InterfaceKind;
use crate::config::JudgeConfig;
use crate::upstream::http::HttpUpstream;
use crate::upstream::UpstreamRequest;
use equiroute_core::AttemptStatus;
use std::sync::Arc;
use std::time::Duration;

/// The default prompt; `{question}` and `{answer}` are replaced.
pub use crate::config::DEFAULT_JUDGE_PROMPT as DEFAULT_PROMPT;

/// A judge attached to an interface.
#[derive(Debug)]
pub struct Judge {
    upstream: HttpUpstream,
    model: String,
    prompt: String,
    sample_rate: f64,
    timeout: Duration,
    slots: Arc<tokio::sync::Semaphore>,
}

impl Judge {
    /// The judge described by `cfg`, sharing the gateway's connections and redactor.
    #[must_use]
    pub fn new(cfg: &JudgeConfig, wiring: crate::upstream::http::Wiring) -> Judge {
        Judge {
            upstream: HttpUpstream::openai(
                wiring,
                &cfg.base_url,
                cfg.api_key.as_ref(),
                equiroute_core::ServiceTier::Standard,
            ),
            model: cfg.model.clone(),
            prompt: cfg.prompt.clone(),
            sample_rate: cfg.sample_rate,
            timeout: Duration::from_secs_f64(cfg.timeout_ms / 1000.0),
            slots: Arc::new(tokio::sync::Semaphore::new(cfg.max_in_flight)),
        }
    }

    /// Whether the answer drawn with `u ∈ [0,1)` is in the judged sample.
    #[must_use]
    pub fn samples(&self, u: f64) -> bool {
        u < self.sample_rate
    }

    /// One of the judge's slots, or `None` when every slot is busy (the caller skips the
    /// answer: judging never queues behind the request path).
    #[must_use]
    pub fn try_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// The judge model's score of `answer` to `question`, in [0, 1]; `None` when the call
    /// fails or the reply holds no score.
    pub async fn score(&self, question: &str, answer: &str) -> Option<f64> {
        let prompt = self
            .prompt
            .replace("{question}", question)
            .replace("{answer}", answer);
        let body = crate::upstream::ClientBody::from_json(serde_json::json!({
            "model": self.model,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }));
        let reply = self
            .upstream
            .call(
                UpstreamRequest {
                    kind: InterfaceKind::Chat,
                    body: &body,
                    model: &self.model,
                    seed: 0,
                },
                Some(self.timeout),
            )
            .await;
        if reply.status != AttemptStatus::Ok {
            return None;
        }
        let text = reply
            .body?
            .value()?
            .pointer("/choices/0/message/content")?
            .as_str()?
            .to_owned();
        parse_score(&text)
    }
}

/// The first number in `text`, as a score in [0, 1]: numbers in (1, 10] are read as out of 10;
/// anything else is no score.
#[must_use]
pub fn parse_score(text: &str) -> Option<f64> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let number: String = text[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let v: f64 = number.trim_end_matches('.').parse().ok()?;
    if (0.0..=1.0).contains(&v) {
        Some(v)
    } else if v > 1.0 && v <= 10.0 {
        Some(v / 10.0)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_read_from_free_text() {
        assert_eq!(parse_score("0.85"), Some(0.85));
        assert_eq!(parse_score("Score: 1"), Some(1.0));
        assert_eq!(parse_score("I'd say 7/10."), Some(0.7));
        assert_eq!(parse_score("no idea"), None);
        assert_eq!(parse_score("42"), None);
    }
}
