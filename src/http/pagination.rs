//! Cursor pagination shared by list routes: `page_size` (clamped to
//! `limits.max_page_size`), an opaque `page_token`, and `next_page_token`.

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use serde::Deserialize;
use utoipa::IntoParams;

use super::error::ApiError;

pub const DEFAULT_PAGE_SIZE: u32 = 50;

#[derive(Debug, Deserialize, IntoParams)]
pub struct PageParams {
    /// How many items to return (default 50, at most `limits.max_page_size`).
    pub page_size: Option<u32>,
    /// The `next_page_token` of the previous page.
    pub page_token: Option<String>,
}

impl PageParams {
    pub fn size(&self, max: u32) -> u32 {
        self.page_size.unwrap_or(DEFAULT_PAGE_SIZE).clamp(1, max)
    }

    /// The decoded cursor, if any.
    pub fn cursor(&self) -> Result<Option<String>, ApiError> {
        let Some(token) = &self.page_token else { return Ok(None) };
        URL_SAFE_NO_PAD
            .decode(token)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .map(Some)
            .ok_or_else(|| ApiError::BadRequest("`page_token` is not a token this API issued".into()))
    }
}

pub fn token(cursor: &str) -> String {
    URL_SAFE_NO_PAD.encode(cursor.as_bytes())
}

/// The next token when the page was full.
pub fn next_token<T>(items: &[T], size: u32, cursor_of: impl Fn(&T) -> String) -> Option<String> {
    (items.len() as u32 == size).then(|| items.last().map(|i| token(&cursor_of(i)))).flatten()
}
