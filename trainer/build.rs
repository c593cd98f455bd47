//! Bakes libtorch's library directory into the rpath of this crate's own binaries (its
//! tests), so nothing needs `LD_LIBRARY_PATH`, and hands the directory on to dependents
//! as `DEP_GRAFT_TRAINER_LIBTORCH_LIB` (link args do not cross packages: the `graft`
//! package's build script adds the same rpath to its binary). torch-sys (links = "tch")
//! reports the directory as `DEP_TCH_LIBTORCH_LIB`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) if !dir.is_empty() => {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
            println!("cargo:rustc-env=GRAFT_LIBTORCH_LIB={dir}");
            println!("cargo:libtorch_lib={dir}");
        }
        _ => println!(
            "cargo:warning=torch-sys did not report libtorch's lib directory; binaries will need LD_LIBRARY_PATH"
        ),
    }
}
