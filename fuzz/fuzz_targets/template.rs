//! Any text as a `{{ expr }}` template, rendered against a message: a string or an error
//! (within the sandbox limits), never a panic or a hang.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        let engine = weir_nodes::script::engine();
        if let Ok(t) = weir_nodes::script::Template::compile(&engine, src, Default::default()) {
            let msg = serde_json::json!({ "payload": { "n": 1, "s": "x" }, "topic": "a/b" });
            let _ = t.render(&engine, &msg);
        }
    }
});
