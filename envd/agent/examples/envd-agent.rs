//! The agent as a binary of this crate alone (std + rustix), for a static build that runs
//! in any root filesystem:
//! `cargo build --release -p graft-envd-agent --example envd-agent --target x86_64-unknown-linux-musl`
//! (the `graft` package's `envd-agent` binary is the same code, linked dynamically).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(graft_envd_agent::main_with(&args));
}
