//! The `graft` binary: a thin shell over the `graft` library's CLI.

fn main() -> std::process::ExitCode {
    graft::cli::main()
}
