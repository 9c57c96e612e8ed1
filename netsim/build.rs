//! In a workspace build `agentjet` comes with its default `torch` feature, so netsim's
//! binaries link LibTorch too; record its folder as an rpath, as the root crate's
//! build.rs does (torch-sys reports the folder only to its direct dependents, so it is
//! read from `LIBTORCH`, which `bootstrap/setup.sh` sets for cargo).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}/lib");
    }
}
