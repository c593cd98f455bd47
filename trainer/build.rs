//! Bakes libtorch's library directory into the rpath of everything that links this crate
//! (tests, the `graft` binary), so nothing needs `LD_LIBRARY_PATH`. torch-sys (links =
//! "tch") exports the directory as `DEP_TCH_LIBTORCH_LIB`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) if !dir.is_empty() => {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
            println!("cargo:rustc-env=GRAFT_LIBTORCH_LIB={dir}");
        }
        _ => println!(
            "cargo:warning=torch-sys did not report libtorch's lib directory; binaries will need LD_LIBRARY_PATH"
        ),
    }
}
