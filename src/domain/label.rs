//! Labels, the movable pointers readers select versions by, and the selectors themselves.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use super::{LabelName, Version};

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Label {
    #[schema(value_type = String)]
    pub name: LabelName,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
    pub updated_by: String,
}

/// A compare-and-set label move.
#[derive(Debug, Clone)]
pub struct LabelMove {
    pub label: LabelName,
    pub to_version: i64,
    /// The version the label must point at now (`None`: it must not exist, or don't care — see `require_current`).
    pub expected_current: Option<i64>,
    /// When false the move happens whatever the label points at.
    pub check_current: bool,
    pub by: String,
}

/// Which version of a prompt a reader wants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Selector {
    Label(LabelName),
    Latest,
    Version(i64),
}

/// A version with the labels that point at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub version: Version,
    pub labels: Vec<LabelName>,
}
