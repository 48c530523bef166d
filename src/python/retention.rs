//! Python bindings of the opt-in retention policies (`crate::pool::retention`):
//! selecting a policy on a fresh manager, the per-free hint, pins, the policy's
//! test clock and its counters. `hscache.vllm.retention` is the glue that reads
//! the hints from `sampling_params.extra_args`.
//!
//! `KVCacheCore`'s one `#[pymethods]` block (`manager.rs`) holds these methods'
//! signatures and docstrings and calls the longer bodies here.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::pool::retention::{RetentionConfig, RetentionHint, RetentionKind};

fn millis(name: &str, seconds: f64) -> PyResult<u64> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(InvalidArgumentError::new_err(format!(
            "{name} must be a non-negative number of seconds, got {seconds}"
        )));
    }
    Ok((seconds * 1000.0).round().min(u64::MAX as f64) as u64)
}

impl PyKVCacheCore {
    /// `KVCacheCore.core_set_retention`'s body (the method: `manager.rs`).
    pub(super) fn core_set_retention_impl(
        &mut self,
        policy: &str,
        default_priority: Option<i64>,
        ttl_s: Option<f64>,
        max_pinned_blocks: Option<i64>,
        slru_protected_blocks: Option<i64>,
        manual_clock: bool,
    ) -> PyResult<()> {
        let kind = RetentionKind::parse(policy)?;
        let pool = self.core.block_pool_mut()?;
        let mut config = RetentionConfig::for_pool(pool.num_gpu_blocks());
        if let Some(p) = default_priority {
            config.default_priority = parse_priority(p)?;
        }
        if let Some(t) = ttl_s {
            config.ttl_ms = millis("ttl_s", t)?;
        }
        if let Some(m) = max_pinned_blocks {
            config.max_pinned_blocks = super::convert::count("max_pinned_blocks", m)?;
        }
        if let Some(s) = slru_protected_blocks {
            config.slru_protected_blocks = super::convert::count("slru_protected_blocks", s)?;
        }
        config.manual_clock = manual_clock;
        Ok(pool.set_retention(kind, config)?)
    }

    /// `KVCacheCore.core_retention_hint`'s body (the method: `manager.rs`).
    pub(super) fn core_retention_hint_impl(
        &mut self,
        priority: Option<i64>,
        duration_s: Option<f64>,
        pin: bool,
    ) -> PyResult<()> {
        let hint = RetentionHint {
            priority: priority.map(parse_priority).transpose()?,
            duration_ms: duration_s
                .map(|d| millis("hscache_retention_s", d))
                .transpose()?,
            pin,
        };
        self.core.block_pool_mut()?.set_retention_hint(hint);
        Ok(())
    }

    /// `KVCacheCore.core_free_retained`'s body (the method: `manager.rs`).
    pub(super) fn core_free_retained_impl(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let rid = request.getattr(intern!(py, "request_id"))?;
        let hint = hint_of(request)?;
        if hint == RetentionHint::default() {
            return slf
                .call_method1(intern!(py, "core_free"), (rid,))
                .map(|_| ());
        }
        slf.try_borrow_mut()?
            .core
            .block_pool_mut()?
            .set_retention_hint(hint);
        let r = slf.call_method1(intern!(py, "core_free"), (rid,));
        if let Ok(mut this) = slf.try_borrow_mut() {
            if let Ok(pool) = this.core.block_pool_mut() {
                pool.clear_retention_hint();
            }
        }
        r.map(|_| ())
    }

    /// `KVCacheCore.retention_advance_clock`'s body (the method: `manager.rs`).
    pub(super) fn retention_advance_clock_impl(&mut self, seconds: f64) -> PyResult<()> {
        let ms = millis("seconds", seconds)?;
        if let Some(r) = self.core.block_pool_mut()?.retention_mut() {
            r.advance_clock(ms);
        }
        Ok(())
    }

    /// `KVCacheCore.retention_stats`'s body (the method: `manager.rs`).
    pub(super) fn retention_stats_impl<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        // Refused on a poisoned manager, like every other read.
        self.core.read("retention_stats", |_| Ok::<_, PyErr>(()))?;
        let pool = self.core.block_pool();
        d.set_item("policy", pool.retention_kind().name())?;
        if let Some(r) = pool.retention() {
            let s = r.stats();
            d.set_item("evictions", s.evictions)?;
            d.set_item("evictions_lowest_class", s.evictions_lowest_class)?;
            d.set_item("expirations", s.expirations)?;
            d.set_item("demotions", s.demotions)?;
            d.set_item("pins_refused", s.pins_refused)?;
            d.set_item("pinned_blocks", r.num_pinned())?;
            d.set_item("pinned_free_blocks", r.num_reserved_free())?;
            d.set_item("evictable_cached_blocks", r.index().len())?;
        }
        Ok(d)
    }
}

fn parse_priority(p: i64) -> PyResult<u8> {
    u8::try_from(p)
        .ok()
        .filter(|&p| p <= crate::pool::retention::priority::MAX_PRIORITY)
        .ok_or_else(|| InvalidArgumentError::new_err(format!("priority must be 0-100, got {p}")))
}

/// The retention hint in a request's `sampling_params.extra_args` (none: default).
fn hint_of(request: &Bound<'_, PyAny>) -> PyResult<RetentionHint> {
    let py = request.py();
    let params = request.getattr(intern!(py, "sampling_params"))?;
    if params.is_none() {
        return Ok(RetentionHint::default());
    }
    let extra = params.getattr(intern!(py, "extra_args"))?;
    let Ok(extra) = extra.cast::<PyDict>() else {
        return Ok(RetentionHint::default());
    };
    if extra.is_empty() {
        return Ok(RetentionHint::default());
    }
    let mut hint = RetentionHint::default();
    if let Some(p) = extra.get_item(intern!(py, "hscache_priority"))? {
        if !p.is_none() {
            hint.priority = Some(parse_priority(p.extract::<i64>()?)?);
        }
    }
    if let Some(d) = extra.get_item(intern!(py, "hscache_retention_s"))? {
        if !d.is_none() {
            hint.duration_ms = Some(millis("hscache_retention_s", d.extract::<f64>()?)?);
        }
    }
    if let Some(p) = extra.get_item(intern!(py, "hscache_pin"))? {
        hint.pin = p.is_truthy()?;
    }
    Ok(hint)
}
