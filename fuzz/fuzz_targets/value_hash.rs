//! libFuzzer target `value_hash`: `tests/fuzz_common::value_hash` (see that module for the properties).
#![no_main]

#[path = "../../tests/fuzz_common/mod.rs"]
mod fuzz_common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_common::value_hash(data);
});
