//! `envd-agent`: the in-sandbox agent of `graft envd` (see `graft_envd::agent`). A binary
//! of its own, linked against `graft-envd` only, so it runs in any sandbox whose root has
//! the C library (the `graft` binary itself may need libraries, e.g. libtorch, that a
//! sandbox cannot see).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(graft_envd::agent::main_with(&args));
}
