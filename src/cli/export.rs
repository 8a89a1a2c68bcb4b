//! `combee traces export PROMPT`: a prompt's traces as a JSON Lines dataset
//! (combee records, chat fine-tuning records or reward records), streamed
//! from `GET /v1/prompts/{name}/export` to a file or stdout as it arrives, so
//! an export of any size needs no memory; the count of records written goes
//! to stderr.

use std::{
    io::Write,
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{Args, ValueEnum};
use reqwest::Method;

use super::client::{ApiClient, CliError, CliResult, Failure, detail, encode, network_error};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Shape {
    /// combee's trace records, with their reward.
    Combee,
    /// `{"messages": [system, …turns, answer]}` for chat fine-tuning.
    Chat,
    /// `{"prompt", "completion", "reward", "success", "version", …}` for RL and preference tuning.
    Reward,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The prompt whose traces to export.
    pub prompt: String,
    /// The record shape.
    #[arg(long, value_enum, default_value = "combee")]
    pub format: Shape,
    /// Only traces that ran with this version (with --label too: only while the label points at it).
    #[arg(long)]
    pub version: Option<u32>,
    /// Only traces that ran with the version this label points at now.
    #[arg(long)]
    pub label: Option<String>,
    /// Only traces received at or after this RFC 3339 time.
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// Only traces received before this RFC 3339 time.
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Only traces whose reward (score, else success as 1/0) is at least this.
    #[arg(long, value_name = "REWARD")]
    pub min_reward: Option<f64>,
    /// Only traces whose reward is at most this.
    #[arg(long, value_name = "REWARD")]
    pub max_reward: Option<f64>,
    /// Write to this file instead of stdout (replaced only once the export is complete).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
}

impl ExportArgs {
    fn path(&self) -> String {
        let format = match self.format {
            Shape::Combee => "combee",
            Shape::Chat => "chat",
            Shape::Reward => "reward",
        };
        let mut query = vec![format!("format={format}")];
        let mut add = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                query.push(format!("{k}={}", encode(&v)));
            }
        };
        add("version", self.version.map(|v| v.to_string()));
        add("label", self.label.clone());
        add("since", self.since.clone());
        add("until", self.until.clone());
        add("min_reward", self.min_reward.map(|r| r.to_string()));
        add("max_reward", self.max_reward.map(|r| r.to_string()));
        format!("/v1/prompts/{}/export?{}", encode(&self.prompt), query.join("&"))
    }
}

/// Streams the export; a failure part-way leaves no `--output` file behind.
pub async fn run(api: &ApiClient, args: ExportArgs) -> CliResult<()> {
    // An export takes as long as it takes: no overall deadline, only the connect one.
    let req = api.request(Method::GET, &args.path()).timeout(Duration::from_secs(7 * 24 * 3600));
    let mut res = req.send().await.map_err(|e| network_error("the server", &e))?;
    let status = res.status();
    if !status.is_success() {
        let body = res.bytes().await.unwrap_or_default();
        return Err(CliError { kind: Failure::from_status(status), status: Some(status), message: detail(&body) });
    }
    let local = |what: &str, e: std::io::Error| CliError::local(format!("{what}: {e}"));
    let (mut sink, partial): (Box<dyn Write>, Option<PathBuf>) = match &args.output {
        Some(path) => {
            let partial = partial_path(path);
            let file = std::fs::File::create(&partial)
                .map_err(|e| local(&format!("cannot write {}", partial.display()), e))?;
            (Box::new(std::io::BufWriter::new(file)), Some(partial))
        }
        None => (Box::new(std::io::BufWriter::new(std::io::stdout().lock())), None),
    };
    let mut records = 0_u64;
    let outcome: CliResult<()> =
        async {
            while let Some(chunk) = res.chunk().await.map_err(|e| {
                CliError::new(Failure::Server, format!("the export stopped part-way ({e}); run it again"))
            })? {
                records += chunk.iter().filter(|b| **b == b'\n').count() as u64;
                sink.write_all(&chunk).map_err(|e| local("cannot write the export", e))?;
            }
            sink.flush().map_err(|e| local("cannot write the export", e))
        }
        .await;
    drop(sink);
    match (outcome, partial, &args.output) {
        (Ok(()), Some(partial), Some(path)) => {
            std::fs::rename(&partial, path).map_err(|e| local(&format!("cannot write {}", path.display()), e))?;
        }
        (Err(e), partial, _) => {
            if let Some(partial) = partial {
                let _ = std::fs::remove_file(partial);
            }
            return Err(e);
        }
        _ => {}
    }
    eprintln!("exported {records} record(s) of {}", args.prompt);
    Ok(())
}

/// Where an export is written until it is complete.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    path.with_file_name(name)
}
