//! ID tokens signed here with test RSA keys (PKCS#8 files made with
//! `openssl genpkey`), checked by [`verify`] as the provider's would be.

use super::*;
use ring::{rand::SystemRandom, signature::RsaKeyPair};
use serde_json::json;

const KEY_A: &[u8] = include_bytes!("testdata/test-key-a.pk8");
const KEY_B: &[u8] = include_bytes!("testdata/test-key-b.pk8");
const NOW: i64 = 1_800_000_000;

fn jwk(der: &[u8], kid: &str) -> Jwk {
    let pair = RsaKeyPair::from_pkcs8(der).unwrap();
    let public = ring::signature::RsaPublicKeyComponents::<Vec<u8>>::from(pair.public());
    Jwk {
        kty: "RSA".into(),
        kid: Some(kid.into()),
        alg: Some("RS256".into()),
        usage: Some("sig".into()),
        n: Some(URL_SAFE_NO_PAD.encode(&public.n)),
        e: Some(URL_SAFE_NO_PAD.encode(&public.e)),
    }
}

fn sign(der: &[u8], header: Value, claims: Value) -> String {
    let pair = RsaKeyPair::from_pkcs8(der).unwrap();
    let message =
        format!("{}.{}", URL_SAFE_NO_PAD.encode(header.to_string()), URL_SAFE_NO_PAD.encode(claims.to_string()));
    let mut signature = vec![0u8; pair.public().modulus_len()];
    pair.sign(&ring::signature::RSA_PKCS1_SHA256, &SystemRandom::new(), message.as_bytes(), &mut signature).unwrap();
    format!("{message}.{}", URL_SAFE_NO_PAD.encode(signature))
}

fn claims() -> Value {
    json!({"iss": "https://id.example.com", "aud": "combee", "sub": "u-1", "exp": NOW + 300, "iat": NOW,
           "nonce": "n-123", "groups": ["team-x"]})
}

fn want() -> Expected<'static> {
    Expected { issuer: "https://id.example.com", client_id: "combee", nonce: "n-123", now: NOW }
}

fn header(kid: &str) -> Value {
    json!({"alg": "RS256", "typ": "JWT", "kid": kid})
}

#[test]
fn a_good_token_verifies_and_gives_its_claims() {
    let keys = [jwk(KEY_B, "b"), jwk(KEY_A, "a")];
    let got = verify(&sign(KEY_A, header("a"), claims()), &keys, &want()).unwrap();
    assert_eq!(got["sub"], "u-1");
    assert_eq!(got["groups"], json!(["team-x"]));
    assert_eq!(key_id(&sign(KEY_A, header("a"), claims())).unwrap().as_deref(), Some("a"));
    // An audience list naming this client alone, or with `azp` naming it.
    let mut c = claims();
    c["aud"] = json!(["combee", "other"]);
    c["azp"] = json!("combee");
    assert!(verify(&sign(KEY_A, header("a"), c), &keys, &want()).is_ok());
}

#[test]
fn a_bad_signature_or_an_unknown_key_is_refused() {
    let keys = [jwk(KEY_A, "a")];
    // Key B's signature under key A's id.
    assert_eq!(verify(&sign(KEY_B, header("a"), claims()), &keys, &want()), Err(TokenError::Signature));
    // A payload changed after signing.
    let good = sign(KEY_A, header("a"), claims());
    let mut parts: Vec<&str> = good.split('.').collect();
    let mut forged = claims();
    forged["sub"] = json!("admin");
    let forged = URL_SAFE_NO_PAD.encode(forged.to_string());
    parts[1] = &forged;
    assert_eq!(verify(&parts.join("."), &keys, &want()), Err(TokenError::Signature));
    assert_eq!(verify(&sign(KEY_A, header("zzz"), claims()), &keys, &want()), Err(TokenError::UnknownKey));
    assert!(!has_key(&keys, Some("zzz")) && has_key(&keys, Some("a")));
    // `none` and symmetric algorithms are never accepted.
    let none = json!({"alg": "none"});
    assert_eq!(verify(&sign(KEY_A, none, claims()), &keys, &want()), Err(TokenError::Algorithm("none".into())));
    let hs = json!({"alg": "HS256", "kid": "a"});
    assert_eq!(verify(&sign(KEY_A, hs, claims()), &keys, &want()), Err(TokenError::Algorithm("HS256".into())));
    assert_eq!(verify("a.b", &keys, &want()), Err(TokenError::Malformed));
}

#[test]
fn issuer_audience_expiry_and_nonce_are_checked() {
    let keys = [jwk(KEY_A, "a")];
    let with = |field: &str, v: Value| {
        let mut c = claims();
        c[field] = v;
        verify(&sign(KEY_A, header("a"), c), &keys, &want())
    };
    assert_eq!(with("iss", json!("https://evil.example.com")), Err(TokenError::Issuer));
    assert_eq!(with("aud", json!("someone-else")), Err(TokenError::Audience));
    assert_eq!(with("aud", json!(["someone-else", "combee"])), Err(TokenError::Audience), "azp missing");
    assert_eq!(with("exp", json!(NOW - LEEWAY_SECS - 1)), Err(TokenError::Expired));
    assert!(with("exp", json!(NOW - 10)).is_ok(), "within the leeway");
    assert_eq!(with("nonce", json!("n-other")), Err(TokenError::Nonce));
    assert_eq!(with("nonce", Value::Null), Err(TokenError::Nonce));
    assert_eq!(with("sub", json!("")), Err(TokenError::Subject));
}

#[test]
fn pkce_challenge_is_the_rfc_example() {
    // RFC 7636, appendix B.
    assert_eq!(
        pkce_challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
        "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    );
}
