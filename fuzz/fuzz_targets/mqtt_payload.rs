//! Any bytes as an MQTT payload: a message (JSON, text or base64), never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let m = weir_triggers::mqtt::message("fuzz/topic", rumqttc::QoS::AtLeastOnce, false, data);
    assert!(m.get("payload").is_some());
    let _ = weir_nodes::mqtt::payload_bytes(&m["payload"]);
});
