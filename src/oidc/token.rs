//! The checks an ID token passes before combee believes who it names: an
//! RS256 signature by a key of the provider's JWKS, then `iss`, `aud`, `exp`
//! and the `nonce` of this sign-in. And PKCE's S256 code challenge. Pure
//! functions over bytes and JSON, so each rule is tested alone.

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Clock skew tolerated on `exp` and `iat`, in seconds.
pub const LEEWAY_SECS: i64 = 60;

/// One key of a JSON Web Key Set; only RSA keys are used.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Jwk {
    pub kty: String,
    #[serde(default)]
    pub kid: Option<String>,
    #[serde(default)]
    pub alg: Option<String>,
    #[serde(default, rename = "use")]
    pub usage: Option<String>,
    #[serde(default)]
    pub n: Option<String>,
    #[serde(default)]
    pub e: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct JwkSet {
    pub keys: Vec<Jwk>,
}

/// Why an ID token was not believed. The messages are shown to the person
/// signing in, so they name the rule, never the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the ID token is not a signed JWT")]
    Malformed,
    #[error("the ID token is signed with {0}, and only RS256 is accepted")]
    Algorithm(String),
    #[error("the ID token is signed by a key the provider does not publish")]
    UnknownKey,
    #[error("the ID token's signature does not verify")]
    Signature,
    #[error("the ID token was issued by another issuer")]
    Issuer,
    #[error("the ID token was issued for another client")]
    Audience,
    #[error("the ID token has expired")]
    Expired,
    #[error("the ID token does not belong to this sign-in (its nonce differs)")]
    Nonce,
    #[error("the ID token names no subject")]
    Subject,
}

/// What the ID token must say.
pub struct Expected<'a> {
    pub issuer: &'a str,
    pub client_id: &'a str,
    pub nonce: &'a str,
    /// Seconds since the epoch.
    pub now: i64,
}

/// PKCE: the S256 challenge of a verifier.
pub fn pkce_challenge(verifier: &str) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

fn part(s: &str) -> Result<Map<String, Value>, TokenError> {
    let bytes = URL_SAFE_NO_PAD.decode(s.trim_end_matches('=')).map_err(|_| TokenError::Malformed)?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(TokenError::Malformed),
    }
}

/// The `kid` of the token's header, if it names one (to tell whether the
/// cached key set is stale).
pub fn key_id(token: &str) -> Result<Option<String>, TokenError> {
    let header = part(token.split('.').next().ok_or(TokenError::Malformed)?)?;
    Ok(header.get("kid").and_then(Value::as_str).map(str::to_owned))
}

/// Whether the set holds a key the token's header names (or any RSA key, when
/// it names none).
pub fn has_key(keys: &[Jwk], kid: Option<&str>) -> bool {
    keys.iter().any(|k| k.kty == "RSA" && (kid.is_none() || k.kid.as_deref() == kid))
}

fn verify_signature(message: &[u8], signature: &[u8], key: &Jwk) -> bool {
    let (Some(n), Some(e)) = (key.n.as_deref(), key.e.as_deref()) else { return false };
    let (Ok(n), Ok(e)) = (URL_SAFE_NO_PAD.decode(n), URL_SAFE_NO_PAD.decode(e)) else { return false };
    ring::signature::RsaPublicKeyComponents { n: &n, e: &e }
        .verify(&ring::signature::RSA_PKCS1_2048_8192_SHA256, message, signature)
        .is_ok()
}

/// The token's claims, once its signature, issuer, audience, expiry and
/// nonce have all been checked, in that order.
pub fn verify(token: &str, keys: &[Jwk], want: &Expected<'_>) -> Result<Map<String, Value>, TokenError> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(TokenError::Malformed);
    };
    let header = part(h)?;
    let alg = header.get("alg").and_then(Value::as_str).unwrap_or("");
    if alg != "RS256" {
        return Err(TokenError::Algorithm(alg.chars().take(16).collect()));
    }
    let kid = header.get("kid").and_then(Value::as_str);
    let candidates: Vec<&Jwk> = keys
        .iter()
        .filter(|k| k.kty == "RSA" && k.usage.as_deref().is_none_or(|u| u == "sig"))
        .filter(|k| k.alg.as_deref().is_none_or(|a| a == "RS256"))
        .filter(|k| kid.is_none() || k.kid.as_deref() == kid)
        .collect();
    if candidates.is_empty() {
        return Err(TokenError::UnknownKey);
    }
    let signature = URL_SAFE_NO_PAD.decode(s).map_err(|_| TokenError::Malformed)?;
    let message = &token.as_bytes()[..h.len() + 1 + p.len()];
    if !candidates.iter().any(|k| verify_signature(message, &signature, k)) {
        return Err(TokenError::Signature);
    }
    let claims = part(p)?;
    let iss = claims.get("iss").and_then(Value::as_str).unwrap_or("");
    if iss.trim_end_matches('/') != want.issuer.trim_end_matches('/') {
        return Err(TokenError::Issuer);
    }
    let audience_ok = match claims.get("aud") {
        Some(Value::String(a)) => a == want.client_id,
        Some(Value::Array(all)) => {
            all.iter().any(|a| a.as_str() == Some(want.client_id))
                && (all.len() == 1 || claims.get("azp").and_then(Value::as_str) == Some(want.client_id))
        }
        _ => false,
    };
    if !audience_ok {
        return Err(TokenError::Audience);
    }
    match claims.get("exp").and_then(Value::as_i64) {
        Some(exp) if exp + LEEWAY_SECS > want.now => {}
        _ => return Err(TokenError::Expired),
    }
    let nonce = claims.get("nonce").and_then(Value::as_str).unwrap_or("");
    if nonce.is_empty() || !bool::from(subtle::ConstantTimeEq::ct_eq(nonce.as_bytes(), want.nonce.as_bytes())) {
        return Err(TokenError::Nonce);
    }
    if claims.get("sub").and_then(Value::as_str).is_none_or(str::is_empty) {
        return Err(TokenError::Subject);
    }
    Ok(claims)
}

#[cfg(test)]
#[path = "token_tests.rs"]
mod tests;
