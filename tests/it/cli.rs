//! The `combee` binary itself: configuration layering, secrets kept out of
//! output, and key administration against a real store.

use std::process::Command;

fn combee(config_dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_combee"));
    cmd.env("COMBEE_CONFIG_DIR", config_dir).env_remove("DATABASE_URL").env_remove("COMBEE_ENV");
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMBEE__")) {
        cmd.env_remove(k);
    }
    cmd
}

/// Runs `combee ARGS` with its config in `dir` and its embedded store under `dir/data`.
fn embedded_cli(dir: &std::path::Path) -> impl Fn(&[&str]) -> std::process::Output + '_ {
    let data = dir.join("data");
    move |args| {
        let mut cmd = combee(dir);
        cmd.args(args).env("COMBEE__DATABASE__DATA_DIR", &data);
        cmd.output().unwrap()
    }
}

fn stdout(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run combee");
    assert!(out.status.success(), "combee failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn config_layers_defaults_file_env_file_and_env_vars() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("default.toml"), "[server]\nbind = \"127.0.0.1:7001\"\nrequest_timeout_secs = 11\n")
        .unwrap();
    std::fs::write(dir.path().join("staging.toml"), "[server]\nbind = \"127.0.0.1:7002\"\n").unwrap();

    let out = stdout(combee(dir.path()).arg("config"));
    assert!(out.contains("127.0.0.1:7001") && out.contains("request_timeout_secs: 11"), "{out}");
    assert!(out.contains("max_traces_per_batch: 500"), "code defaults fill the rest");

    let mut cmd = combee(dir.path());
    cmd.arg("config").env("COMBEE_ENV", "staging");
    assert!(stdout(&mut cmd).contains("127.0.0.1:7002"));

    let mut cmd = combee(dir.path());
    cmd.arg("config")
        .env("COMBEE_ENV", "staging")
        .env("COMBEE__SERVER__BIND", "127.0.0.1:7003")
        .env("DATABASE_URL", "postgres://user:hunter2@db.internal/combee");
    let out = stdout(&mut cmd);
    assert!(out.contains("127.0.0.1:7003"), "env vars win");
    assert!(!out.contains("hunter2") && out.contains("[redacted]"), "secrets never printed: {out}");
}

#[test]
fn bad_configuration_is_reported_without_secrets() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("default.toml"), "[server]\nbind = \"not an address\"\n").unwrap();
    let out = combee(dir.path()).arg("config").env("DATABASE_URL", "postgres://u:hunter2@h/d").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bind") && !err.contains("hunter2"), "{err}");
    let mut cmd = combee(dir.path());
    cmd.arg("config").env("COMBEE__LIMITS__MAX_PAGE_SIZE", "0");
    std::fs::write(dir.path().join("default.toml"), "").unwrap();
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_page_size must be greater than 0"));
}

/// A key the reader does not know stops start-up, named, from a file or an
/// environment variable alike: how a previous release meets a key added since,
/// so during a rolling upgrade each process keeps the configuration it was
/// started with (docs/operations.md).
#[test]
fn an_unknown_key_stops_start_up_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("default.toml"), "[database]\nadded_later = \"postgres://u:hunter2@h/d\"\n")
        .unwrap();
    let out = combee(dir.path()).arg("config").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("added_later") && !err.contains("hunter2"), "{err}");

    std::fs::write(dir.path().join("default.toml"), "").unwrap();
    assert!(combee(dir.path()).arg("config").output().unwrap().status.success());
    let out = combee(dir.path()).arg("config").env("COMBEE__WORKER__ADDED_LATER", "1").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("added_later"));
}

#[test]
fn keys_create_list_revoke_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let run = embedded_cli(dir.path());
    let out = run(&["keys", "create", "--name", "agent-1", "--scopes", "traces:write,prompts:read"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let secret = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(secret.starts_with("cmb_") && secret.len() == 44);
    let list = String::from_utf8(run(&["keys", "list"]).stdout).unwrap();
    assert!(list.contains("agent-1") && list.contains("traces:write,prompts:read") && list.contains("active"));
    assert!(!list.contains(&secret[12..]), "secrets are never listed");
    assert!(run(&["keys", "revoke", &secret[..12]]).status.success());
    assert!(String::from_utf8(run(&["keys", "list"]).stdout).unwrap().contains("revoked"));
    let bad = run(&["keys", "create", "--scopes", "root"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown scope"));
    assert!(run(&["migrate"]).status.success());
}

#[test]
fn members_set_list_remove_on_the_embedded_store_and_the_client_secret_never_prints() {
    let dir = tempfile::tempdir().unwrap();
    let run = embedded_cli(dir.path());
    // A grant names a project that exists (`default` does from the start).
    let out = run(&["members", "set", "ann@example.com", "--project", "nowhere", "--role", "operator"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("project \"nowhere\" not found"), "{out:?}");
    let out = run(&["members", "set", "ann@example.com", "--project", "default", "--role", "operator"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ann@example.com is operator in default");
    assert!(run(&["members", "set", "sre-lead", "--role", "admin"]).status.success());
    let list = String::from_utf8(run(&["members", "list"]).stdout).unwrap();
    assert!(list.contains("ann@example.com") && list.contains("operator"), "{list}");
    assert!(list.contains("sre-lead") && list.contains("(every project)"), "{list}");
    let bad = run(&["members", "set", "ann@example.com", "--role", "owner"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("unknown role"));
    let bad = run(&["members", "set", "ann@example.com", "--project", "Not A Project", "--role", "viewer"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("not a project name"));
    assert!(run(&["members", "remove", "ann@example.com"]).status.success());
    let gone = run(&["members", "remove", "ann@example.com"]);
    assert!(!gone.status.success() && String::from_utf8_lossy(&gone.stderr).contains("no member"));
    assert!(!String::from_utf8(run(&["members", "list"]).stdout).unwrap().contains("ann@example.com"));

    // Single sign-on settings are checked at start-up, and the client secret never prints.
    let oidc = [
        ("COMBEE__AUTH__OIDC__ISSUER", "https://id.example.com"),
        ("COMBEE__AUTH__OIDC__CLIENT_ID", "combee"),
        ("COMBEE__AUTH__OIDC__CLIENT_SECRET", "hunter2-oidc"),
        ("COMBEE__AUTH__OIDC__REDIRECT_URL", "https://combee.example.com/ui/oidc/callback"),
    ];
    let out = stdout(combee(dir.path()).arg("config").envs(oidc));
    assert!(out.contains("https://id.example.com") && !out.contains("hunter2-oidc"), "{out}");
    let out =
        combee(dir.path()).arg("config").envs(oidc).env("COMBEE__AUTH__OIDC__REDIRECT_URL", "https://x/").output();
    let out = out.unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("auth.oidc.redirect_url") && !err.contains("hunter2-oidc"), "{err}");
}

/// The binary allocates with jemalloc and reads its options from the variable
/// the operations guide names: asked to, it prints its statistics at exit.
#[test]
fn the_allocator_is_jemalloc_and_takes_its_options_from_the_documented_variable() {
    let dir = tempfile::tempdir().unwrap();
    let out = combee(dir.path()).arg("--version").env("_RJEM_MALLOC_CONF", "stats_print:true").output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Begin jemalloc statistics"), "no jemalloc statistics at exit: {err}");
    let plain = combee(dir.path()).arg("--version").output().unwrap();
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("jemalloc"), "statistics only when asked for");
}
