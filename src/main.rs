//! The `graft` binary: a thin shell over the `graft` library's CLI.

/// mimalloc instead of glibc's malloc: a call allocates and frees many small JSON values on
/// whichever worker thread it runs, where glibc's arenas spend much of the gateway's CPU
/// (`malloc_consolidate`, `_int_free`; see docs/BENCHMARKS.md, "Where a call's CPU goes").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    graft::cli::main()
}
