//! The `combee` binary: parse the command line and hand over to the library.

use clap::Parser;

/// mimalloc rather than the system allocator: a request allocates and frees
/// many small values (parsed JSON, rows, answers) across the runtime's threads,
/// and glibc's malloc spent a third of the server's CPU on batched ingest
/// (`docs/benchmarks.md`). Built without transparent huge pages (`no_thp`):
/// with them, a server holding 10,000 prompts for 100,000 subjects kept
/// 139 MB resident against 111 MB with glibc's malloc; without, 112 MB.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
