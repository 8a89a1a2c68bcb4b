//! A key revoked with `combee keys revoke` — another process, writing to the
//! store directly — stops working in the running server within a second: on
//! Postgres as soon as the revoking process's NOTIFY arrives, on both stores
//! when the server's next read of the key generation sees it move.

use crate::common;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use common::{Backend, TestApp, eventually, spawn_app};

fn revoke_with_the_cli(app: &TestApp, prefix: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["keys", "revoke", prefix])
        .env("DATABASE_URL", &app.url)
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", &app.data_dir)
        .env("COMBEE__LOG__LEVEL", "warn")
        .output()
        .expect("run combee keys revoke");
    assert!(out.status.success(), "combee keys revoke failed: {}", String::from_utf8_lossy(&out.stderr));
}

async fn status_with(app: &TestApp, secret: &str) -> u16 {
    app.http.get(app.url("/v1/prompts/p")).bearer_auth(secret).send().await.unwrap().status().as_u16()
}

async fn a_key_revoked_by_the_cli_stops_working_in_the_running_server(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let revoked = app.key_with(&["prompts:read"]).await;
    let kept = app.key_with(&["prompts:read"]).await;
    // Used, so the server has both keys cached.
    for _ in 0..3 {
        assert_eq!(status_with(&app, &revoked).await, 200);
        assert_eq!(status_with(&app, &kept).await, 200);
    }
    revoke_with_the_cli(&app, &revoked[..12]);
    let revoked_at = Instant::now();
    let refused_after = eventually("the revoked key is refused", Duration::from_secs(1), async || {
        match status_with(&app, &revoked).await {
            401 => Ok(revoked_at.elapsed()),
            status => Err(format!("it is still answered {status}")),
        }
    })
    .await;
    eprintln!("{b:?}: revoked key refused {refused_after:?} after the CLI exited");
    assert_eq!(status_with(&app, &revoked).await, 401);
    assert_eq!(status_with(&app, &kept).await, 200, "other keys keep working");
}

on_both_stores!(a_key_revoked_by_the_cli_stops_working_in_the_running_server);
