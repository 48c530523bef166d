//! libFuzzer target `manager_ops`: `tests/fuzz_common::manager_ops` (see that module for the properties).
#![no_main]

#[path = "../../tests/fuzz_common/mod.rs"]
mod fuzz_common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_common::manager_ops(data);
});
