//! The steady decode step's decisions (`hscache.vllm.step`, `docs/fast_step.md`).
//!
//! vLLM's `Scheduler.schedule()` and `update_from_output()` spend most of a steady decode
//! step deciding nothing. The fast path serves those steps; this module holds its rules as
//! pure functions over per-request facts, so that the bindings (`src/python/step_*.rs`)
//! only read a `Request`'s fields, call them and write back what vLLM's code would:
//!
//! - [`schedule`]: how many tokens a running request schedules this step (the step's
//!   allocation is the manager's `allocate_slots` per request, driven by the binding);
//!   its rules are [`schedule::ScheduleRule`].
//! - [`update`]: whether a sampled token certainly does not stop a request (the negation
//!   of vLLM's `check_stop` for one token), and which requests need nothing but the token
//!   appended; its rules are [`update::UpdateRule`].
//!
//! Each phase declares its rules with [`step_rules!`] in its own file, so adding a rule
//! is one enum variant beside the code it guards (plus the binding's read of any new
//! fact, and one row of the differential's table). The rules the Python glue applies
//! itself (waiting queues, the budget, preemption, ...) are named in
//! `hscache.vllm.step.rules`.
//!
//! [`BrokenRules`] is the set of test-only mutants the differential must catch. The
//! bindings ask [`armed`] for it: always empty, a constant, unless the crate is built
//! with the `mutants` feature (the test-hooks extension of `scripts/panic_python.sh`),
//! where `_core._break_step_rules` sets it for the process.

pub mod schedule;
pub mod update;

#[cfg(feature = "mutants")]
use std::sync::atomic::{AtomicU32, Ordering};

/// A set of rules of one phase (implemented by [`step_rules!`]).
pub trait RuleSet: Copy + 'static {
    /// Every rule of the phase, in declaration order.
    const ALL: &'static [Self];
    /// The first bit of the phase in a [`BrokenRules`] mask.
    const BASE: u32;
    /// The rule's index within its phase.
    fn index(self) -> u32;
    /// The rule's name (as `hscache.vllm.step.RULES` lists it).
    fn name(self) -> &'static str;

    /// The rule named `name`, if the phase has one.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|r| r.name() == name)
    }

    /// Every rule's name, in declaration order.
    fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|r| r.name()).collect()
    }
}

/// Declares a phase's rules: a fieldless enum with a name per variant and its
/// [`RuleSet`] at bit `base` of a [`BrokenRules`] mask (16 rules per phase at most).
#[macro_export]
macro_rules! step_rules {
    (
        $(#[$meta:meta])*
        pub enum $name:ident at $base:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $crate::step::RuleSet for $name {
            const ALL: &'static [Self] = &[$( $name::$variant, )+];
            const BASE: u32 = $base;

            #[inline]
            fn index(self) -> u32 {
                self as u32
            }

            fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        const _: () = assert!(
            <$name as $crate::step::RuleSet>::ALL.len() <= 16,
            "a phase has at most 16 rules"
        );
    };
}

/// The rules a test-only mutant breaks (empty in production).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BrokenRules(u32);

impl BrokenRules {
    /// No rule broken.
    pub const NONE: BrokenRules = BrokenRules(0);

    fn bit<R: RuleSet>(rule: R) -> u32 {
        1 << (R::BASE + rule.index())
    }

    /// The set with `rule` added.
    #[must_use]
    pub fn with<R: RuleSet>(self, rule: R) -> BrokenRules {
        BrokenRules(self.0 | Self::bit(rule))
    }

    /// Whether `rule` is broken.
    #[inline]
    pub fn breaks<R: RuleSet>(self, rule: R) -> bool {
        self.0 & Self::bit(rule) != 0
    }

    /// Whether every rule holds.
    #[inline]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The set naming `names`, every one a rule of either phase; the first unknown name
    /// otherwise.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, &'a str> {
        let mut broken = BrokenRules::NONE;
        for name in names {
            broken = if let Some(r) = schedule::ScheduleRule::from_name(name) {
                broken.with(r)
            } else if let Some(r) = update::UpdateRule::from_name(name) {
                broken.with(r)
            } else {
                return Err(name);
            };
        }
        Ok(broken)
    }
}

/// The mutants armed in this process (the `mutants` build only; see [`arm`]).
#[cfg(feature = "mutants")]
static ARMED: AtomicU32 = AtomicU32::new(0);

/// The rules broken in this process: what the bindings pass to the rules. Without the
/// `mutants` feature it is the constant [`BrokenRules::NONE`], so every mutant branch
/// of a release build folds away.
#[inline]
pub fn armed() -> BrokenRules {
    #[cfg(feature = "mutants")]
    {
        BrokenRules(ARMED.load(Ordering::Relaxed))
    }
    #[cfg(not(feature = "mutants"))]
    {
        BrokenRules::NONE
    }
}

/// Test only (the `mutants` build): breaks `broken` in this process from now on
/// (`NONE` disarms).
#[cfg(feature = "mutants")]
pub fn arm(broken: BrokenRules) {
    ARMED.store(broken.0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::schedule::ScheduleRule;
    use super::update::UpdateRule;
    use super::{BrokenRules, RuleSet};

    fn check<R: RuleSet + PartialEq + std::fmt::Debug>() {
        for &rule in R::ALL {
            assert_eq!(R::from_name(rule.name()), Some(rule));
            let broken = BrokenRules::NONE.with(rule);
            for &other in R::ALL {
                assert_eq!(broken.breaks(other), other == rule);
            }
        }
        assert_eq!(R::from_name("nope"), None);
    }

    #[test]
    fn names_round_trip_and_masks_are_per_rule() {
        check::<ScheduleRule>();
        check::<UpdateRule>();
        // The phases' masks do not overlap.
        let s = BrokenRules::NONE.with(ScheduleRule::ChunkTokens);
        assert!(UpdateRule::ALL.iter().all(|&r| !s.breaks(r)));
        let u = BrokenRules::NONE.with(UpdateRule::StopEos);
        assert!(ScheduleRule::ALL.iter().all(|&r| !u.breaks(r)));
    }

    #[test]
    fn names_parse_across_phases() {
        let b = BrokenRules::from_names(["chunk_tokens", "stop_eos"]).unwrap();
        assert!(b.breaks(ScheduleRule::ChunkTokens) && b.breaks(UpdateRule::StopEos));
        assert_eq!(BrokenRules::from_names(["stop_eos", "nope"]), Err("nope"));
        assert!(BrokenRules::from_names([]).unwrap().is_empty());
    }
}
