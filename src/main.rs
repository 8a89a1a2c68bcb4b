//! The `combee` binary: parse the command line and hand over to the library.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Usage errors exit 1, not clap's 2: 2 means "not found" to scripts.
    let cli = match combee::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS };
        }
    };
    match combee::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("combee: {e:#}");
            std::process::ExitCode::from(combee::cli::client::exit_code(&e))
        }
    }
}
