//! Standard Webhooks (standardwebhooks.com): HMAC-SHA256 over
//! `{webhook-id}.{webhook-timestamp}.{body}` with a `whsec_<base64>` secret,
//! signatures sent as space-separated `v1,<base64>` entries. Used to verify
//! inbound round triggers and to sign outbound events.

use base64::{Engine, engine::general_purpose::STANDARD};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::secret::Secret;

pub const SECRET_PREFIX: &str = "whsec_";

/// The key bytes of a `whsec_…` secret.
pub fn decode_secret(secret: &Secret) -> Option<Vec<u8>> {
    let b64 = secret.expose().strip_prefix(SECRET_PREFIX)?;
    STANDARD.decode(b64).ok().filter(|k| !k.is_empty())
}

fn mac(key: &[u8], id: &str, timestamp: &str, body: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("hmac takes any key"));
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `webhook-signature` value for a message.
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let tag = mac(key, id, &timestamp.to_string(), body).finalize().into_bytes();
    format!("v1,{}", STANDARD.encode(tag))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("missing `{0}` header")]
    Missing(&'static str),
    #[error("`webhook-timestamp` is not a Unix timestamp")]
    BadTimestamp,
    #[error("`webhook-timestamp` is more than {0} seconds away from now")]
    Stale(i64),
    #[error("no signature in `webhook-signature` matches")]
    BadSignature,
}

pub struct Incoming<'a> {
    pub id: Option<&'a str>,
    pub timestamp: Option<&'a str>,
    pub signature: Option<&'a str>,
    pub body: &'a [u8],
}

/// Checks the timestamp window first, then the signatures (constant time).
pub fn verify(keys: &[Vec<u8>], msg: &Incoming<'_>, now: i64, tolerance_secs: i64) -> Result<(), VerifyError> {
    let id = msg.id.filter(|s| !s.is_empty()).ok_or(VerifyError::Missing("webhook-id"))?;
    let ts_raw = msg.timestamp.ok_or(VerifyError::Missing("webhook-timestamp"))?;
    let sigs = msg.signature.ok_or(VerifyError::Missing("webhook-signature"))?;
    let ts: i64 = ts_raw.trim().parse().map_err(|_| VerifyError::BadTimestamp)?;
    if (now - ts).abs() > tolerance_secs {
        return Err(VerifyError::Stale(tolerance_secs));
    }
    for entry in sigs.split_whitespace() {
        let Some(("v1", b64)) = entry.split_once(',') else { continue };
        let Ok(given) = STANDARD.decode(b64) else { continue };
        if keys.iter().any(|k| mac(k, id, ts_raw.trim(), msg.body).verify_slice(&given).is_ok()) {
            return Ok(());
        }
    }
    Err(VerifyError::BadSignature)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The example from the Standard Webhooks specification's reference tests.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1614265330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn key() -> Vec<u8> {
        decode_secret(&Secret::new(SECRET)).unwrap()
    }

    fn msg<'a>(ts: &'a str, sig: &'a str) -> Incoming<'a> {
        Incoming { id: Some(ID), timestamp: Some(ts), signature: Some(sig), body: BODY }
    }

    #[test]
    fn matches_the_specification_example() {
        assert_eq!(sign(&key(), ID, TS, BODY), EXPECTED);
        assert_eq!(verify(&[key()], &msg(&TS.to_string(), EXPECTED), TS, 300), Ok(()));
    }

    #[test]
    fn rejects_stale_tampered_and_unsigned_messages() {
        let ts = TS.to_string();
        assert_eq!(verify(&[key()], &msg(&ts, EXPECTED), TS + 301, 300), Err(VerifyError::Stale(300)));
        assert_eq!(verify(&[key()], &msg(&ts, EXPECTED), TS - 301, 300), Err(VerifyError::Stale(300)));
        let tampered = Incoming { body: b"{}", ..msg(&ts, EXPECTED) };
        assert_eq!(verify(&[key()], &tampered, TS, 300), Err(VerifyError::BadSignature));
        assert_eq!(verify(&[key()], &msg(&ts, "v1,AAAA v2,xyz"), TS, 300), Err(VerifyError::BadSignature));
        assert_eq!(verify(&[key()], &msg("soon", EXPECTED), TS, 300), Err(VerifyError::BadTimestamp));
        let unsigned = Incoming { signature: None, ..msg(&ts, EXPECTED) };
        assert_eq!(verify(&[key()], &unsigned, TS, 300), Err(VerifyError::Missing("webhook-signature")));
    }

    #[test]
    fn any_of_several_signatures_or_keys_may_match() {
        let other = decode_secret(&Secret::new("whsec_c2VjcmV0")).unwrap();
        let both = format!("v1,Zm9v {EXPECTED}");
        assert_eq!(verify(&[other, key()], &msg(&TS.to_string(), &both), TS, 300), Ok(()));
        assert!(decode_secret(&Secret::new("nope")).is_none());
    }
}
