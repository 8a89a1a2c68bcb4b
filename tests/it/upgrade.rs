//! A rolling upgrade on one Postgres, with no downtime: the previous release's
//! binary (the commit in release/previous, built from git history in a target
//! directory of its own) serves agents, an API and a worker process; this
//! tree's binary starts beside it and migrates the schema to the newest
//! migrations; then the old processes are stopped one by one, each drained
//! first as a load balancer does, while the agents keep posting traces and
//! reading their prompt. No request may fail, every acknowledged trace must be
//! readable at the end, and learning rounds must go on after the switch. The
//! agents' prompt and key belong to a project other than `default`, so both
//! releases find it by name while the schema is keyed by project and name;
//! once the old processes are gone, `default` takes the same name, which the
//! agents never notice.
//!
//! Skipped, saying so, only where git history is unavailable (a shallow clone
//! or a source tree without git); CI clones the full history.

use crate::common::{
    self, eventually,
    private_postgres::PrivatePostgres,
    processes::{Build, Process, free_port, ready},
};

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use combee::simulation::llm::SimConfig;
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use sqlx::Connection;

const PROMPT: &str = "rolling";
const PROJECT: &str = "fleet";
const AGENTS: usize = 4;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `git -C <repo> <args>`; `None` when git cannot be run at all.
fn git(args: &[&str]) -> Option<Output> {
    Command::new("git").arg("-C").arg(repo()).args(args).stderr(Stdio::piped()).output().ok()
}

/// The commit release/previous names: comment lines start with `#`, the one
/// other line is a full commit hash.
fn previous_commit() -> String {
    let text = std::fs::read_to_string(repo().join("release/previous")).expect("release/previous");
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    match lines[..] {
        [commit] if commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()) => commit.to_owned(),
        _ => panic!("release/previous must hold one full commit hash besides its `#` comments: {text:?}"),
    }
}

/// Why the commit cannot be read here, when that is because git history is
/// unavailable; a full clone without the commit fails the test instead.
fn history_unavailable(commit: &str) -> Option<String> {
    let Some(found) = git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]) else {
        return Some("git cannot be run here".into());
    };
    if found.status.success() {
        return None;
    }
    if !git(&["rev-parse", "--git-dir"]).is_some_and(|o| o.status.success()) {
        return Some(format!("{} is not a git checkout", repo().display()));
    }
    let shallow = git(&["rev-parse", "--is-shallow-repository"]).expect("git ran a moment ago");
    assert!(
        String::from_utf8_lossy(&shallow.stdout).trim() == "true",
        "release/previous names {commit}, which this full clone does not have"
    );
    Some(format!("the clone is shallow and lacks {commit}"))
}

/// The previous release: its binary and its own `config/` (its reader refuses
/// keys added since), and what building it took when it was not cached.
struct Previous {
    build: Build,
    built: Option<BuildFigures>,
}

struct BuildFigures {
    took: Duration,
    compiled: Vec<String>,
    seeded: bool,
}

/// Runs `cmd`, failing the test with its output when it fails.
fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The previous release's binary, built once per commit and kept under the
/// target directory (`previous-release/<commit>/`, never `debug/combee`, which
/// the other tests run). The build gets a target directory of its own, seeded
/// with this build's compiled dependencies (`deps`, `build`, `.fingerprint`,
/// combee's own units left out), so cargo compiles only what differs: combee
/// itself, and any dependency whose version changed since.
fn previous_release(commit: &str) -> Previous {
    let debug = Path::new(env!("CARGO_BIN_EXE_combee")).parent().expect("the binary's directory");
    let home = debug.parent().expect("the target directory").join("previous-release");
    let cached = home.join(commit);
    let build = Build { bin: cached.join("combee"), config: cached.join("config") };
    if build.bin.exists() {
        return Previous { build, built: None };
    }
    let work = home.join("work");
    let _ = std::fs::remove_dir_all(&work);
    let (src, target) = (work.join("src"), work.join("target"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(target.join("debug")).unwrap();
    let started = Instant::now();
    let mut archive = Command::new("git")
        .arg("-C")
        .arg(repo())
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .expect("git archive");
    let untar = Command::new("tar").arg("-x").arg("-C").arg(&src).stdin(archive.stdout.take().unwrap()).status();
    assert!(archive.wait().unwrap().success() && untar.unwrap().success(), "git archive {commit} | tar -x");
    let mut seeded = true;
    // The compiled crates as hard links (gigabytes, not copied: rustc replaces an
    // output file rather than writing into it); the fingerprints and build-script
    // outputs as copies (megabytes: cargo rewrites those files in place, which
    // through a link would change this build's).
    for (dir, how) in [("deps", "-al"), ("build", "-a"), (".fingerprint", "-a")] {
        if debug.join(dir).exists() {
            let seed = Command::new("cp").arg(how).arg(debug.join(dir)).arg(target.join("debug")).status();
            seeded &= seed.is_ok_and(|s| s.success());
            // Not combee's own units: cargo names them alike in both trees (their
            // paths are taken relative to the workspace) and the old tree's files
            // are older than this build's, so it would take this tree's for fresh.
            for entry in std::fs::read_dir(target.join("debug").join(dir)).into_iter().flatten() {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy();
                if name.starts_with("combee") || name.starts_with("libcombee") {
                    let gone = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                    gone.unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
                }
            }
        }
    }
    // The suite's own binary is built beside the tests, with the features the
    // dev-dependencies add to shared crates; an empty test target of the old
    // tree's makes its build resolve the same features, and so reuse the same
    // compiled dependencies (a binary alone would recompile some of them).
    std::fs::create_dir_all(src.join("tests")).unwrap();
    let probe = "previous_release_build";
    std::fs::write(src.join("tests").join(format!("{probe}.rs")), "//! Only so the build resolves test features.\n")
        .unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // Niced: the other tests run beside this build.
    let mut build_cmd = Command::new("nice");
    build_cmd
        .args(["-n", "10"])
        .arg(cargo)
        .args(["build", "-p", "combee", "--bin", "combee", "--test", probe])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .env_remove("OUT_DIR")
        .stdin(Stdio::null());
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO") && !configures_cargo(&name) {
            build_cmd.env_remove(&*name);
        }
    }
    let out = run(&mut build_cmd, &format!("cargo build of the previous release {commit}"));
    let took = started.elapsed();
    let compiled: Vec<String> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Compiling "))
        .map(|l| l.split_whitespace().next().unwrap_or(l).to_owned())
        .collect();
    let old_lib = std::fs::read_dir(target.join("debug/deps")).unwrap().flatten().any(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name.starts_with("libcombee-") && name.ends_with(".rlib")
    });
    assert!(old_lib, "combee's library was compiled from the previous release's tree (none was seeded)");
    let same = |file: &str| std::fs::read(src.join(file)).ok() == std::fs::read(repo().join(file)).ok();
    if seeded && same("Cargo.lock") && same("Cargo.toml") {
        assert_eq!(
            compiled,
            ["combee"],
            "with the same dependencies, cargo reuses every one from the seeded directory"
        );
    }
    // Its configuration first, the binary last: a cached binary means a complete entry.
    let config = cached.join("config");
    std::fs::create_dir_all(&config).unwrap();
    for file in std::fs::read_dir(src.join("config")).expect("the previous release's config/") {
        let file = file.unwrap().path();
        std::fs::copy(&file, config.join(file.file_name().unwrap())).unwrap();
    }
    let partial = cached.join("combee.partial");
    std::fs::copy(target.join("debug/combee"), &partial).expect("the built binary");
    std::fs::rename(&partial, &build.bin).unwrap();
    let _ = std::fs::remove_dir_all(&work);
    Previous { build, built: Some(BuildFigures { took, compiled, seeded }) }
}

/// Whether the variable `name` configures cargo, and so is kept for the nested
/// build, rather than describing the test being run (`CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_NAME`, … set by cargo and nextest): some build scripts (ring's)
/// rerun when one of those differs from their last run, and every crate above
/// them would be compiled again.
fn configures_cargo(name: &str) -> bool {
    const CONFIG: [&str; 12] = [
        "CARGO_HOME",
        "CARGO_INCREMENTAL",
        "CARGO_BUILD_",
        "CARGO_PROFILE_",
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRIES_",
        "CARGO_REGISTRY_",
        "CARGO_TERM_",
        "CARGO_UNSTABLE_",
        "CARGO_LOG",
        "CARGO_TARGET_",
    ];
    name != "CARGO_TARGET_TMPDIR" && CONFIG.iter().any(|prefix| name.starts_with(prefix))
}

/// The bases agents send their requests to, as a load balancer holds them.
type Fleet = Arc<RwLock<Vec<String>>>;

/// What one agent sent and saw.
#[derive(Default)]
struct Tally {
    requests: usize,
    /// Ids of the traces acknowledged (2xx).
    acknowledged: Vec<String>,
    /// Every request not answered 2xx, with why.
    failures: Vec<String>,
}

fn trace(agent: usize, n: usize, j: usize) -> Value {
    let lesson = (n * 2 + j) % 40;
    json!({
        "prompt": PROMPT,
        "input": {"agent": agent, "n": n, "j": j},
        "output": format!("answer {n}"),
        "feedback": {"success": !n.is_multiple_of(3), "comment": format!("INSIGHT-r{lesson:02}: check field {lesson} before answering")}
    })
}

/// An agent: posts two traces, reads its prompt, pauses briefly, again, each
/// time at the next process of the fleet, until `stop`.
async fn agent(http: reqwest::Client, fleet: Fleet, key: String, me: usize, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let base = {
            let bases = fleet.read().unwrap();
            bases[(n + me) % bases.len()].clone()
        };
        let batch = json!({"traces": [trace(me, n, 0), trace(me, n, 1)]});
        tally.requests += 2;
        match http.post(format!("{base}/v1/traces")).bearer_auth(&key).json(&batch).send().await {
            Ok(r) if r.status().is_success() => {
                let body: Value = r.json().await.expect("an acknowledgement is JSON");
                let ids = body["ids"].as_array().expect("ids");
                tally.acknowledged.extend(ids.iter().map(|id| id.as_str().unwrap().to_owned()));
            }
            Ok(r) => tally.failures.push(format!("POST {base}/v1/traces: {} {}", r.status(), r.text().await.unwrap())),
            Err(e) => tally.failures.push(format!("POST {base}/v1/traces: {e}")),
        }
        match http.get(format!("{base}/v1/prompts/{PROMPT}")).bearer_auth(&key).send().await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => tally.failures.push(format!("GET {base}/v1/prompts/{PROMPT}: {}", r.status())),
            Err(e) => tally.failures.push(format!("GET {base}/v1/prompts/{PROMPT}: {e}")),
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tally
}

/// The applied migrations: how many, and the newest.
async fn schema(db: &str) -> (i64, i64) {
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    sqlx::query_as("SELECT count(*), max(version) FROM _sqlx_migrations").fetch_one(&mut c).await.unwrap()
}

/// A `serve --role <role>` process of `build` on `db`, learning through `llm`
/// with short leases (a stopped worker's round is taken over within seconds).
fn start(build: &Build, role: &str, db: &str, data: &Path, llm: &str) -> (Process, String) {
    let port = free_port();
    let child = build
        .serve(role, port, db, data)
        .env("COMBEE__LLM__BASE_URL", llm)
        .env("COMBEE__LLM__MAX_CONCURRENCY", "2")
        .env("COMBEE__WORKER__POLL_INTERVAL_MS", "50")
        .env("COMBEE__WORKER__LEASE_SECS", "4")
        .env("COMBEE__WORKER__HEARTBEAT_SECS", "1")
        .spawn()
        .unwrap_or_else(|e| panic!("start {} --role {role}: {e}", build.bin.display()));
    (Process(child), format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_hands_over_to_this_one_under_load_without_a_failed_request() {
    let commit = previous_commit();
    if let Some(why) = history_unavailable(&commit) {
        eprintln!(
            "SKIPPED: git history is unavailable ({why}); the rolling-upgrade test builds release/previous from it"
        );
        return;
    }
    let previous = previous_release(&commit);
    match &previous.built {
        Some(b) => eprintln!(
            "previous release {commit} built in {:.1} s ({} target directory; compiled: {})",
            b.took.as_secs_f64(),
            if b.seeded { "seeded" } else { "unseeded" },
            b.compiled.join(", ")
        ),
        None => eprintln!("previous release {commit}: cached at {}", previous.build.bin.display()),
    }
    let this = Build::this();
    // The new binary reads the old configuration file too (keys are only added, with defaults).
    run(
        Command::new(&this.bin).arg("config").env("COMBEE_CONFIG_DIR", &previous.build.config),
        "this binary reading the previous release's configuration",
    );

    let pg = PrivatePostgres::start();
    let db = pg.url();
    let sim = common::spawn_sim(SimConfig { seed: 11, fixed_ms: 20.0, ..SimConfig::default() }).await;
    let data = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();

    // The previous release: an API process (it migrates the new database and
    // writes the first admin key), then a worker.
    let (mut old_api, old_api_base) = start(&previous.build, "api", &db, data.path(), &sim.url);
    ready(&http, &old_api_base).await;
    let (mut old_worker, old_worker_base) = start(&previous.build, "worker", &db, data.path(), &sim.url);
    ready(&http, &old_worker_base).await;
    let (old_migrations, old_newest) = schema(&db).await;
    let admin = std::fs::read_to_string(data.path().join("admin-key")).expect("the admin key").trim().to_owned();
    let res = http.post(format!("{old_api_base}/v1/projects")).bearer_auth(&admin).json(&json!({"name": PROJECT}));
    assert_eq!(res.send().await.unwrap().status(), 201);
    let res = http
        .post(format!("{old_api_base}/v1/prompts"))
        .bearer_auth(&admin)
        .json(&json!({"name": PROMPT, "base": "You answer support questions.", "strategy": "playbook",
                      "promotion": "auto", "settings": {"batch_size": 40}, "project": PROJECT}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let res = http
        .post(format!("{old_api_base}/v1/keys"))
        .bearer_auth(&admin)
        .json(&json!({"name": "agents", "scopes": ["traces:write", "prompts:read"], "project": PROJECT}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let key = res.json::<Value>().await.unwrap()["secret"].as_str().unwrap().to_owned();

    let started = Instant::now();
    let fleet: Fleet = Arc::new(RwLock::new(vec![old_api_base.clone()]));
    let stop = Arc::new(AtomicBool::new(false));
    let agents: Vec<_> =
        (0..AGENTS).map(|me| tokio::spawn(agent(http.clone(), fleet.clone(), key.clone(), me, stop.clone()))).collect();
    tokio::time::sleep(Duration::from_secs(4)).await;

    // This release starts beside it: the first of its processes migrates.
    let (_new_api, new_api_base) = start(&this, "api", &db, data.path(), &sim.url);
    ready(&http, &new_api_base).await;
    let (_new_worker, new_worker_base) = start(&this, "worker", &db, data.path(), &sim.url);
    ready(&http, &new_worker_base).await;
    let (new_migrations, new_newest) = schema(&db).await;
    fleet.write().unwrap().push(new_api_base.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The old processes stop one by one: the API drained (out of the fleet) first.
    fleet.write().unwrap().retain(|b| *b != old_api_base);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let api_exit = old_api.terminate();
    assert!(api_exit.success(), "the previous release's API process stopped with {api_exit}");
    let worker_exit = old_worker.terminate();
    assert!(worker_exit.success(), "the previous release's worker stopped with {worker_exit}");
    let (switched, switched_at) = (chrono::Utc::now(), started.elapsed());
    // Names are per project now: `default` takes the agents' prompt's name, and they go on as before.
    let res = http
        .post(format!("{new_api_base}/v1/prompts"))
        .bearer_auth(&admin)
        .json(&json!({"name": PROMPT, "base": "Another team's prompt."}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());

    // The server-wide key writes the agents' prompt `fleet/rolling`.
    let rounds_url = format!("{new_api_base}/v1/prompts/{PROJECT}%2F{PROMPT}/rounds?page_size=200");
    let rounds = || async {
        let page: Value = http.get(&rounds_url).bearer_auth(&admin).send().await.unwrap().json().await.unwrap();
        page["rounds"].as_array().unwrap().clone()
    };
    let finished_after = |r: &Value| {
        r["finished_at"]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .is_some_and(|t| t > switched)
    };
    // A round of this release's worker that succeeded: it published a version, or (once the
    // playbook holds every lesson the agents send) what it learned left the text as it was.
    let after = eventually("a round that succeeded after the switch", Duration::from_secs(90), async || {
        let all = rounds().await;
        let done = all.iter().find(|r| r["status"] == "succeeded" && finished_after(r));
        done.cloned().ok_or_else(|| format!("{} rounds, none succeeded after the switch", all.len()))
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::default();
    for a in agents {
        let t = a.await.unwrap();
        tally.requests += t.requests;
        tally.acknowledged.extend(t.acknowledged);
        tally.failures.extend(t.failures);
    }
    let duration = started.elapsed();
    assert!(
        tally.failures.is_empty(),
        "{} of {} requests failed; the first: {:#?}",
        tally.failures.len(),
        tally.requests,
        &tally.failures[..tally.failures.len().min(10)]
    );

    // Every acknowledged trace is there, read by its id.
    let lost: Vec<String> = stream::iter(tally.acknowledged.iter())
        .map(|id| {
            let req = http.get(format!("{new_api_base}/v1/traces/{id}")).bearer_auth(&admin);
            async move {
                match req.send().await {
                    Ok(r) if r.status() == 200 => None,
                    Ok(r) => Some(format!("{id}: {}", r.status())),
                    Err(e) => Some(format!("{id}: {e}")),
                }
            }
        })
        .buffer_unordered(16)
        .filter_map(|lost| async move { lost })
        .collect()
        .await;
    assert!(lost.is_empty(), "{} acknowledged traces are not readable: {:?}", lost.len(), &lost[..lost.len().min(10)]);
    let prompt: Value = http
        .get(format!("{new_api_base}/v1/prompts/{PROMPT}"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let published = after["result_version"].as_i64();
    let finished = chrono::DateTime::parse_from_rfc3339(after["finished_at"].as_str().unwrap()).unwrap();
    let published_after = (finished.with_timezone(&chrono::Utc) - switched).as_seconds_f64();
    assert_eq!(prompt["name"], format!("{PROJECT}/{PROMPT}"), "the served name works for any key: {prompt}");
    if let Some(published) = published {
        assert!(prompt["version"].as_i64() >= Some(published), "version {published} is served: {prompt}");
    }
    let result = published.map_or_else(|| "the prompt unchanged".to_owned(), |v| format!("version {v} published"));

    let all = rounds().await;
    let succeeded = all.iter().filter(|r| r["status"] == "succeeded").count();
    let after_switch = all.iter().filter(|r| r["status"] == "succeeded" && finished_after(r)).count();
    eprintln!(
        "rolling upgrade {commit} -> this tree: {} requests ({AGENTS} agents, traces and prompt reads), {} failed; {} \
         traces acknowledged, {} lost; schema {old_migrations} migrations (newest {old_newest}) -> {new_migrations} \
         (newest {new_newest}); {succeeded} rounds succeeded, {after_switch} after the switch (the first: {result}, \
         {published_after:.1} s after it); switch at {:.1} s, {:.1} s in all",
        tally.requests,
        tally.failures.len(),
        tally.acknowledged.len(),
        lost.len(),
        switched_at.as_secs_f64(),
        duration.as_secs_f64()
    );
}
