//! libFuzzer target `request_hash`: `tests/fuzz_common::request_hash` (see that module for the properties).
#![no_main]

#[path = "../../tests/fuzz_common/mod.rs"]
mod fuzz_common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_common::request_hash(data);
});
