//! Embedded schema migrations: the SQL files under `migrations/` are compiled
//! into the binary, applied in order at start-up and by `combee migrate`, and
//! recorded with a checksum so an edited, already-applied file is caught.

use sha2::{Digest, Sha256};

pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

impl Migration {
    pub fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.sql.as_bytes()))
    }
}

pub const POSTGRES: &[Migration] = &[
    Migration { version: 1, name: "foundation", sql: include_str!("../../migrations/postgres/0001_foundation.sql") },
    Migration { version: 2, name: "rounds", sql: include_str!("../../migrations/postgres/0002_rounds.sql") },
    Migration { version: 3, name: "controller", sql: include_str!("../../migrations/postgres/0003_controller.sql") },
    Migration { version: 4, name: "webhooks", sql: include_str!("../../migrations/postgres/0004_webhooks.sql") },
    Migration { version: 5, name: "ui_sessions", sql: include_str!("../../migrations/postgres/0005_ui_sessions.sql") },
    Migration {
        version: 6,
        name: "key_generation",
        sql: include_str!("../../migrations/postgres/0006_key_generation.sql"),
    },
    Migration {
        version: 7,
        name: "poisoning_controls",
        sql: include_str!("../../migrations/postgres/0007_poisoning_controls.sql"),
    },
    Migration {
        version: 8,
        name: "reflections_by_trace",
        sql: include_str!("../../migrations/postgres/0008_reflections_by_trace.sql"),
    },
    Migration { version: 10, name: "otlp_spans", sql: include_str!("../../migrations/postgres/0010_otlp_spans.sql") },
    Migration { version: 11, name: "label_moves", sql: include_str!("../../migrations/postgres/0011_label_moves.sql") },
    Migration {
        version: 12,
        name: "overload_meter",
        sql: include_str!("../../migrations/postgres/0012_overload_meter.sql"),
    },
    Migration { version: 13, name: "population", sql: include_str!("../../migrations/postgres/0013_population.sql") },
    Migration { version: 14, name: "crossover", sql: include_str!("../../migrations/postgres/0014_crossover.sql") },
];

pub const SQLITE: &[Migration] = &[
    Migration { version: 1, name: "foundation", sql: include_str!("../../migrations/sqlite/0001_foundation.sql") },
    Migration { version: 2, name: "rounds", sql: include_str!("../../migrations/sqlite/0002_rounds.sql") },
    Migration { version: 3, name: "controller", sql: include_str!("../../migrations/sqlite/0003_controller.sql") },
    Migration { version: 4, name: "webhooks", sql: include_str!("../../migrations/sqlite/0004_webhooks.sql") },
    Migration { version: 5, name: "ui_sessions", sql: include_str!("../../migrations/sqlite/0005_ui_sessions.sql") },
    Migration {
        version: 6,
        name: "key_generation",
        sql: include_str!("../../migrations/sqlite/0006_key_generation.sql"),
    },
    Migration {
        version: 7,
        name: "poisoning_controls",
        sql: include_str!("../../migrations/sqlite/0007_poisoning_controls.sql"),
    },
    Migration {
        version: 8,
        name: "reflections_by_trace",
        sql: include_str!("../../migrations/sqlite/0008_reflections_by_trace.sql"),
    },
    Migration { version: 10, name: "otlp_spans", sql: include_str!("../../migrations/sqlite/0010_otlp_spans.sql") },
    Migration { version: 11, name: "label_moves", sql: include_str!("../../migrations/sqlite/0011_label_moves.sql") },
    Migration {
        version: 12,
        name: "overload_meter",
        sql: include_str!("../../migrations/sqlite/0012_overload_meter.sql"),
    },
    Migration { version: 13, name: "population", sql: include_str!("../../migrations/sqlite/0013_population.sql") },
    Migration { version: 14, name: "crossover", sql: include_str!("../../migrations/sqlite/0014_crossover.sql") },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_stores_have_the_same_migration_sequence() {
        let pg: Vec<_> = POSTGRES.iter().map(|m| (m.version, m.name)).collect();
        let lite: Vec<_> = SQLITE.iter().map(|m| (m.version, m.name)).collect();
        assert_eq!(pg, lite);
        // Strictly increasing; a gap is allowed while a parallel branch's number is not merged yet.
        assert!(pg.windows(2).all(|w| w[0].0 < w[1].0));
    }
}
