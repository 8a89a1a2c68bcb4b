//! The `combee` binary: parse the command line and hand over to the library.

use clap::Parser;

/// mimalloc rather than the system allocator: a request allocates and frees
/// many small values (parsed JSON, rows, answers) across the runtime's threads,
/// and glibc's malloc spent a third of the server's CPU on batched ingest
/// (`docs/benchmarks.md`). Built without transparent huge pages (`no_thp`),
/// and set to return freed pages at once (see [`return_freed_pages_at_once`]):
/// otherwise a server that had ingested and then served 10,000 prompts to
/// 100,000 subjects held 10 to 40 MB more than with glibc's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_t`, which the
/// Rust bindings leave unnamed): how long freed pages stay resident before
/// they go back to the OS (1 s by default).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed pages go back to the OS at once rather than after a second: same
/// ingest figures, and resident memory as with glibc's malloc.
fn return_freed_pages_at_once() {
    // Safety: called once, before the runtime starts any other thread.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

fn main() -> std::process::ExitCode {
    return_freed_pages_at_once();
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(run()),
        Err(e) => {
            eprintln!("combee: cannot start the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> std::process::ExitCode {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The option's number names the purge delay in the vendored mimalloc:
    /// its default there is 1,000 ms, and setting it reads back.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // Safety: reads and sets an option; this test is alone in its process under nextest.
        unsafe {
            if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
                assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY), 1000);
            }
            return_freed_pages_at_once();
            assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY), 0);
        }
    }
}
