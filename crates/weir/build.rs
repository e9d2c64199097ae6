//! Release builds of the `weir` binary lay out its code in the order of `symbol-order.txt`:
//! the functions a start and an idle engine run first, together, then those a load adds.
//! The kernel maps the 64 KiB around each page of code a process first touches, so scattered,
//! they kept about 8 MiB of code resident at idle; together, about 3.5 MiB. Regenerate the
//! file with `crates/weir/symbol-order.sh` (why and when: its header).

use std::env::var;

fn main() {
    println!("cargo::rerun-if-changed=symbol-order.txt");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=WEIR_SYMBOL_ORDER");
    let release = var("PROFILE").is_ok_and(|p| p == "release");
    // rustc links this target with its bundled lld, which knows the option; another linker
    // (one configured for the target, or chosen in RUSTFLAGS) may not, so it is left alone.
    let flags = var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let lld = var("TARGET").is_ok_and(|t| t == "x86_64-unknown-linux-gnu")
        && var("RUSTC_LINKER").is_err()
        && !flags.contains("linker")
        && !flags.contains("fuse-ld");
    let wanted = var("WEIR_SYMBOL_ORDER").map_or(true, |v| v != "0");
    let file = std::path::Path::new(&var("CARGO_MANIFEST_DIR").unwrap()).join("symbol-order.txt");
    if release && lld && wanted && file.is_file() {
        // One argument each, passed to the linker as they are (no splitting at commas).
        // Names the file no longer matches (a dependency updated, a function renamed) are
        // skipped quietly: the layout is a matter of memory, never of correctness.
        for arg in [
            format!("--symbol-ordering-file={}", file.display()),
            "--no-warn-symbol-ordering".to_string(),
        ] {
            println!("cargo::rustc-link-arg-bins=-Xlinker");
            println!("cargo::rustc-link-arg-bins={arg}");
        }
    }
}
