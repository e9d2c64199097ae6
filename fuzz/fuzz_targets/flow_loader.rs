//! Any text as a flow file: a flow or positioned errors, never a panic or a hang.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        let _ = weir_nodes::Library::builtin().load_str("fuzz.yaml", src);
    }
});
