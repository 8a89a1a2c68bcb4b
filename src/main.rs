//! The `combee` binary: parse the command line and hand over to the library.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match combee::cli::run(combee::cli::Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("combee: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
