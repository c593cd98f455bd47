//! With the `trainer` feature, the `graft` binary links libtorch: bake its directory
//! (reported by graft-trainer's build script) into the rpath, so it runs without
//! `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_GRAFT_TRAINER_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_GRAFT_TRAINER_LIBTORCH_LIB")
        && !dir.is_empty()
    {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
