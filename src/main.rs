//! The `combee` binary: parse the command line and hand over to the library.

use clap::Parser;

/// The allocator: a request allocates and frees many small buffers from
/// whichever worker thread runs it, which glibc's allocator serves with
/// locked arenas and periodic consolidation (a fifth of the server's time
/// under a write load); jemalloc keeps per-thread caches.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
