//! AWS event-stream framing (`application/vnd.amazon.eventstream`), the binary framing of
//! Bedrock's `ConverseStream`: each message is a 12-byte prelude (total length, headers
//! length, CRC32 of those 8 bytes), headers, a payload and a CRC32 of everything before it.
//!
//! The decoder checks both CRCs and never trusts a length field: a message longer than
//! [`MAX_MESSAGE_BYTES`] or shorter than its own framing ends the stream as broken before
//! anything is buffered for it. The encoder writes string headers only (all Bedrock sends),
//! for the mock upstream and the tests.

/// The longest message accepted (Bedrock's own limit is far below: events carry a few KiB).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Prelude (12) and message CRC (4).
const FRAMING_BYTES: usize = 16;

/// One decoded message: its string headers and its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl Message {
    /// The value of the string header `name` (`:event-type`, `:message-type`, ...).
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why the byte stream is not event-stream messages; the stream is broken there.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("an event-stream message declares {0} bytes (the limit is {MAX_MESSAGE_BYTES})")]
    TooLong(usize),
    #[error("an event-stream message declares a length its framing does not fit in")]
    BadLength,
    #[error("an event-stream message's prelude CRC does not match")]
    PreludeCrc,
    #[error("an event-stream message's CRC does not match")]
    MessageCrc,
    #[error("an event-stream message has malformed headers")]
    BadHeaders,
    #[error("the event stream ended inside a message")]
    Truncated,
}

/// Splits bytes, as they arrive, into messages.
#[derive(Debug, Default)]
pub struct Decoder {
    pending: Vec<u8>,
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

impl Decoder {
    /// Takes the next bytes; returns the messages they complete.
    ///
    /// # Errors
    /// A length out of bounds, a CRC mismatch or malformed headers.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Message>, FrameError> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            if rest.len() < 12 {
                break;
            }
            // Checked before the length is believed: a flipped bit must not make us wait for
            // (or buffer) gigabytes.
            if crc32fast::hash(&rest[..8]) != be32(&rest[8..12]) {
                return Err(FrameError::PreludeCrc);
            }
            let total = be32(&rest[0..4]) as usize;
            let headers_len = be32(&rest[4..8]) as usize;
            if total > MAX_MESSAGE_BYTES {
                return Err(FrameError::TooLong(total));
            }
            if total < FRAMING_BYTES || headers_len > total - FRAMING_BYTES {
                return Err(FrameError::BadLength);
            }
            if rest.len() < total {
                break;
            }
            let frame = &rest[..total];
            if crc32fast::hash(&frame[..total - 4]) != be32(&frame[total - 4..]) {
                return Err(FrameError::MessageCrc);
            }
            let headers = headers(&frame[12..12 + headers_len])?;
            let payload = frame[12 + headers_len..total - 4].to_vec();
            out.push(Message { headers, payload });
            start += total;
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// The stream ended: nothing may be left of a message.
    ///
    /// # Errors
    /// A message was cut.
    pub fn end(&mut self) -> Result<(), FrameError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated)
        }
    }
}

/// The headers block: name length (1 byte), name, type (1 byte), value. String values are
/// kept; the other types are skipped by their size.
fn headers(mut b: &[u8]) -> Result<Vec<(String, String)>, FrameError> {
    let mut out = Vec::new();
    let take = |b: &mut &[u8], n: usize| -> Result<Vec<u8>, FrameError> {
        if b.len() < n {
            return Err(FrameError::BadHeaders);
        }
        let (head, tail) = b.split_at(n);
        *b = tail;
        Ok(head.to_vec())
    };
    while !b.is_empty() {
        let name_len = take(&mut b, 1)?[0] as usize;
        let name =
            String::from_utf8(take(&mut b, name_len)?).map_err(|_| FrameError::BadHeaders)?;
        let kind = take(&mut b, 1)?[0];
        let fixed = match kind {
            0 | 1 => Some(0),
            2 => Some(1),
            3 => Some(2),
            4 => Some(4),
            5 | 8 => Some(8),
            9 => Some(16),
            6 | 7 => None,
            _ => return Err(FrameError::BadHeaders),
        };
        if let Some(n) = fixed {
            take(&mut b, n)?;
            continue;
        }
        let len = take(&mut b, 2)?;
        let value = take(&mut b, usize::from(u16::from_be_bytes([len[0], len[1]])))?;
        if kind == 7 {
            let value = String::from_utf8(value).map_err(|_| FrameError::BadHeaders)?;
            out.push((name, value));
        }
    }
    Ok(out)
}

/// One message with string `headers` and `payload`, framed and checksummed.
#[must_use]
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut head = Vec::new();
    for (name, value) in headers {
        head.push(name.len() as u8);
        head.extend_from_slice(name.as_bytes());
        head.push(7);
        head.extend_from_slice(&(value.len() as u16).to_be_bytes());
        head.extend_from_slice(value.as_bytes());
    }
    let total = FRAMING_BYTES + head.len() + payload.len();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(total as u32).to_be_bytes());
    out.extend_from_slice(&(head.len() as u32).to_be_bytes());
    out.extend_from_slice(&crc32fast::hash(&out[..8]).to_be_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc32fast::hash(&out).to_be_bytes());
    out
}

/// An event of type `event` (`messageStart`, `contentBlockDelta`, ...) with a JSON payload.
#[must_use]
pub fn event(event: &str, payload: &serde_json::Value) -> Vec<u8> {
    encode(
        &[
            (":event-type", event),
            (":content-type", "application/json"),
            (":message-type", "event"),
        ],
        payload.to_string().as_bytes(),
    )
}

/// An exception of type `kind` (`throttlingException`, ...) with Bedrock's `{"message"}`.
#[must_use]
pub fn exception(kind: &str, message: &str) -> Vec<u8> {
    encode(
        &[
            (":exception-type", kind),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        serde_json::json!({ "message": message })
            .to_string()
            .as_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_split_anywhere_decode_whole() {
        let mut bytes = event("messageStart", &json!({"role": "assistant"}));
        bytes.extend(event(
            "contentBlockDelta",
            &json!({"delta": {"text": "Hi"}, "contentBlockIndex": 0}),
        ));
        bytes.extend(exception("throttlingException", "slow down"));
        let mut d = Decoder::default();
        let mut got = Vec::new();
        for piece in bytes.chunks(7) {
            got.extend(d.feed(piece).unwrap());
        }
        d.end().unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].header(":event-type"), Some("messageStart"));
        assert_eq!(got[0].payload, br#"{"role":"assistant"}"#);
        assert_eq!(got[2].header(":message-type"), Some("exception"));
        assert_eq!(
            got[2].header(":exception-type"),
            Some("throttlingException")
        );
    }

    #[test]
    fn a_message_crc_mismatch_breaks_the_stream() {
        let mut bytes = event("messageStart", &json!({"role": "assistant"}));
        let at = bytes.len() - 6;
        bytes[at] ^= 1; // a payload byte
        assert_eq!(Decoder::default().feed(&bytes), Err(FrameError::MessageCrc));
        let mut bytes = event("messageStart", &json!({}));
        bytes[9] ^= 1; // the prelude's CRC
        assert_eq!(Decoder::default().feed(&bytes), Err(FrameError::PreludeCrc));
    }

    #[test]
    fn a_truncated_message_is_an_error_at_the_end() {
        let bytes = event("messageStop", &json!({"stopReason": "end_turn"}));
        let mut d = Decoder::default();
        assert!(d.feed(&bytes[..bytes.len() - 3]).unwrap().is_empty());
        assert_eq!(d.end(), Err(FrameError::Truncated));
        // A stream that ends between messages is whole.
        let mut d = Decoder::default();
        assert_eq!(d.feed(&bytes).unwrap().len(), 1);
        assert_eq!(d.end(), Ok(()));
    }

    #[test]
    fn a_length_field_is_never_trusted() {
        // A prelude that says 4 GiB, with a valid prelude CRC: refused at once, nothing held.
        let mut prelude = Vec::new();
        prelude.extend_from_slice(&u32::MAX.to_be_bytes());
        prelude.extend_from_slice(&0u32.to_be_bytes());
        prelude.extend_from_slice(&crc32fast::hash(&prelude).to_be_bytes());
        assert_eq!(
            Decoder::default().feed(&prelude),
            Err(FrameError::TooLong(u32::MAX as usize))
        );
        // Just over the bound.
        let mut prelude = Vec::new();
        prelude.extend_from_slice(&((MAX_MESSAGE_BYTES + 1) as u32).to_be_bytes());
        prelude.extend_from_slice(&0u32.to_be_bytes());
        prelude.extend_from_slice(&crc32fast::hash(&prelude).to_be_bytes());
        assert!(matches!(
            Decoder::default().feed(&prelude),
            Err(FrameError::TooLong(_))
        ));
        // Shorter than its own framing, or headers longer than the message.
        for (total, headers) in [(8u32, 0u32), (20, 10)] {
            let mut prelude = Vec::new();
            prelude.extend_from_slice(&total.to_be_bytes());
            prelude.extend_from_slice(&headers.to_be_bytes());
            prelude.extend_from_slice(&crc32fast::hash(&prelude).to_be_bytes());
            assert_eq!(
                Decoder::default().feed(&prelude),
                Err(FrameError::BadLength)
            );
        }
    }
}
