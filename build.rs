//! Makes the `agentjet-peer` binary (and tests, benches) find LibTorch at run time
//! without LD_LIBRARY_PATH: torch-sys tells us where libtorch lives
//! (`cargo:libtorch_lib`, visible here as `DEP_TCH_LIBTORCH_LIB`), and we record that
//! folder as an rpath. On CUDA builds the linker would drop `libtorch_cuda.so` as unneeded
//! (no symbol of it is referenced directly) and CUDA would look unavailable, so it is
//! linked with `--no-as-needed`.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!("cargo:warning=torch-sys did not report its libtorch folder; set LD_LIBRARY_PATH to run");
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    if Path::new(&dir).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{dir}");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
