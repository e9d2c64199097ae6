//! Any text as a function node's Rhai script, run against a message inside weir's sandbox:
//! a result or an error naming the limit, never a panic, a hang or runaway memory.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        let engine = weir_nodes::script::engine();
        if let Ok(ast) = engine.compile(src) {
            let msg =
                serde_json::json!({ "payload": { "n": 1, "s": "x", "a": [1, 2] }, "topic": "t" });
            if let Ok(v) = weir_nodes::script::eval(&engine, &ast, &msg) {
                let _ = weir_nodes::script::from_dynamic(&v);
            }
        }
    }
});
