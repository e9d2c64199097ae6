//! Release builds of the `weir` binary lay out its code in the order of `symbol-order.txt`:
//! the functions a start and an idle engine run first, together, then those a load adds.
//! The kernel maps the 64 KiB around each page of code a process first touches, so scattered,
//! they kept about 8 MB of code resident at idle; together, about 3 MB. Regenerate the file
//! with `crates/weir/symbol-order.sh` (why and when: its header).

fn main() {
    println!("cargo::rerun-if-changed=symbol-order.txt");
    println!("cargo::rerun-if-changed=build.rs");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    if release && linux {
        let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("symbol-order.txt");
        // Names the file no longer matches (a dependency updated, a function renamed) are
        // skipped quietly: the layout is a matter of memory, never of correctness.
        println!(
            "cargo::rustc-link-arg-bins=-Wl,--symbol-ordering-file={},--no-warn-symbol-ordering",
            file.display()
        );
    }
}
