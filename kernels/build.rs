//! With the `torch` feature, records LibTorch's folder (reported by torch-sys) as an rpath
//! so this crate's test binaries run without LD_LIBRARY_PATH, as the main crate's do.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
