//! `envd-agent`: the in-sandbox agent as a standalone binary (`graft envd agent` is the
//! same code). See `graft_envd::agent`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(graft_envd::agent::main_with(&args));
}
