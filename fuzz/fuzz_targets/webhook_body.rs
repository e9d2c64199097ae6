//! Any bytes as a webhook body, with or without a JSON content type: a payload or a 400/415,
//! never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for ct in ["application/json", "text/plain", ""] {
        let mut headers = axum::http::HeaderMap::new();
        if !ct.is_empty() {
            headers.insert("content-type", ct.parse().unwrap());
        }
        let _ = weir_triggers::webhook::decode(&headers, data);
    }
});
