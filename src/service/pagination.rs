//! Cursor pagination shared by list routes: `page_size` (clamped to
//! `limits.max_page_size`), an opaque `page_token`, and `next_page_token`.
//! A token is the cursor itself in a plain grammar per list (a prompt name, a
//! decimal number, a UUID in 32 hex digits), so every string of the grammar the
//! OpenAPI document states is one the server accepts (see `openapi.rs`).

use serde::Deserialize;
use utoipa::IntoParams;

use super::error::ServiceError;

pub const DEFAULT_PAGE_SIZE: u32 = 50;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
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

    /// The cursor, if any (each list parses it in its own grammar).
    pub fn cursor(&self) -> Result<Option<String>, ServiceError> {
        match &self.page_token {
            Some(t) if t.is_empty() || t.len() > 64 => {
                Err(ServiceError::BadRequest("`page_token` is not a token this API issued".into()))
            }
            other => Ok(other.clone()),
        }
    }
}

pub fn token(cursor: &str) -> String {
    cursor.to_owned()
}

/// The next token when the page was full.
pub fn next_token<T>(items: &[T], size: u32, cursor_of: impl Fn(&T) -> String) -> Option<String> {
    (items.len() as u32 == size).then(|| items.last().map(|i| token(&cursor_of(i)))).flatten()
}
