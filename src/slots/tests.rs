//! Unit tests of the slot mirror, including one regression test per bug vllm-omni's
//! hidden-state prefix cache reported, each run on the real mirror (must pass) and on
//! a mirror with the matching deliberate defect (must catch it).

use rustc_hash::FxHashMap;

use super::*;
use crate::error::ErrorKind as K;

fn start<'a>(
    req_id: &'a str,
    block_ids: &'a [BlockId],
    hit: usize,
    n: usize,
) -> ScheduledRequest<'a> {
    ScheduledRequest::start(req_id, block_ids, hit, n)
}

fn cont<'a>(req_id: &'a str, new_block_ids: &'a [BlockId], n: usize) -> ScheduledRequest<'a> {
    ScheduledRequest::cont(req_id, new_block_ids, n)
}

fn plan(m: &mut SlotMirror, scheduled: Vec<ScheduledRequest<'_>>) -> StepRef {
    m.plan_step(&StepInput {
        scheduled,
        ..Default::default()
    })
    .unwrap()
}

fn step(m: &mut SlotMirror, scheduled: Vec<ScheduledRequest<'_>>) -> (Vec<i64>, StepReads) {
    let id = plan(m, scheduled);
    let slots = m.write_slots().collect();
    (slots, m.commit(id).unwrap())
}

#[test]
fn write_slots_follow_the_block_table() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    let (slots, reads) = step(&mut m, vec![start("a", &[3, 7], 0, 6)]);
    assert_eq!(slots, vec![12, 13, 14, 15, 28, 29]);
    assert!(reads.entries().is_empty() && reads.misses().is_empty());
    let (slots, _) = step(&mut m, vec![cont("a", &[], 2)]);
    assert_eq!(slots, vec![30, 31]);
    let (slots, _) = step(&mut m, vec![cont("a", &[2], 1)]);
    assert_eq!(slots, vec![8]);
    assert_eq!(m.block_table("a").unwrap(), &[3, 7, 2]);
    assert_eq!(m.num_computed_tokens("a").unwrap(), 9);
}

#[test]
fn decode_rows_follow_appended_blocks() {
    let mut m = SlotMirror::new(16, 4).unwrap();
    step(&mut m, vec![start("a", &[3, 7], 0, 8)]);
    let mut want = Vec::new();
    let mut got = Vec::new();
    let mut table = vec![3u32, 7];
    for pos in 8..21usize {
        let new: Vec<BlockId> = if pos % 4 == 0 {
            vec![8 + pos as BlockId / 4]
        } else {
            vec![]
        };
        table.extend(&new);
        want.push((table[pos / 4] as usize * 4 + pos % 4) as i64);
        let (slots, _) = step(&mut m, vec![cont("a", &new, 1)]);
        got.extend(slots);
    }
    assert_eq!(got, want);
    assert_eq!(m.block_table("a").unwrap(), table.as_slice());
    // Every decoded row was counted in its block.
    assert_eq!(m.block_state(10).unwrap().1, 4);
    assert_eq!(m.block_state(13).unwrap().1, 1);
}

#[test]
fn hit_after_write_reads_cached_and_new_rows() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3, 7, 2], 0, 10)]);
    let (slots, reads) = step(&mut m, vec![start("b", &[3, 7, 5], 8, 3)]);
    assert_eq!(slots, vec![20, 21, 22]);
    assert_eq!(reads.entries().len(), 1);
    let e = reads.entries()[0];
    assert_eq!(
        (
            e.plan_index,
            e.num_tokens,
            e.num_cached_tokens,
            e.skip_layers
        ),
        (0, 11, 8, true)
    );
    let read: Vec<i64> = reads.slots().collect();
    assert_eq!(read, vec![12, 13, 14, 15, 28, 29, 30, 31, 20, 21, 22]);
    assert_eq!(m.stats().cached_rows_served, 8);
}

#[test]
fn hit_on_rows_never_written_is_a_miss() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    // a's chunk covers only 2 rows of block 3; b claims the full block.
    let (_, reads) = step(
        &mut m,
        vec![start("a", &[3, 7], 0, 2), start("b", &[3, 6], 4, 1)],
    );
    assert!(reads.entries().is_empty());
    assert_eq!(reads.misses(), &[1]);
    assert_eq!(reads.miss_blocks(), &[3], "the first block that failed");
    assert_eq!(m.stats().read_misses, 1);
}

#[test]
fn a_reread_serves_the_kept_table_after_a_recomputation() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    // a computes block 3 in a step never committed; b hits it: a miss on block 3.
    plan(&mut m, vec![start("a", &[3, 7], 0, 5)]);
    let (_, reads) = step(&mut m, vec![start("b", &[3, 6], 4, 1)]);
    assert_eq!((reads.misses(), reads.miss_blocks()), (&[0][..], &[3][..]));
    // The scheduler rolls b back to 0... or, shared, to its hit: b recomputes block 3
    // itself, then reads [0, 8) again with its table unchanged (nothing bumped).
    let epoch = m.block_state(3).unwrap().0;
    let reread = |nc: usize, n: usize| ScheduledRequest {
        req_id: "b",
        assignment: Assignment::Continue {
            new_block_ids: &[],
            num_computed_tokens: Some(nc),
            reread: true,
        },
        num_scheduled_tokens: n,
    };
    let (slots, reads) = step(&mut m, vec![reread(0, 5)]);
    assert_eq!(slots, vec![12, 13, 14, 15, 24]);
    assert!(
        reads.entries().is_empty(),
        "a read from 0 reads nothing cached"
    );
    assert_eq!(m.block_state(3).unwrap().0, epoch, "not bumped");
    let (_, reads) = step(&mut m, vec![start("c", &[3, 6], 4, 4)]);
    assert_eq!(reads.entries().len(), 1);
    // A re-read from a block boundary reads the rows before it.
    let (slots, reads) = step(&mut m, vec![reread(4, 2)]);
    assert_eq!(slots, vec![24, 25]);
    assert_eq!(reads.entries()[0].num_cached_tokens, 4);
    assert_eq!(reads.entries()[0].num_tokens, 6);
    // Not block aligned: refused before anything changes.
    let e = m.plan_step(&StepInput {
        scheduled: vec![reread(5, 1)],
        ..Default::default()
    });
    assert!(e.is_err());
}

#[test]
fn non_aligned_hit_recomputes_the_gap() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3, 7], 0, 8)]);
    // A hit of 6 tokens: the cached span ends at 4, rows 4.. are computed.
    let id = plan(&mut m, vec![start("b", &[3, 5, 6], 6, 3)]);
    let p = m.planned()[0];
    assert_eq!((p.compute_start, p.num_tokens, p.read), (4, 9, true));
    assert_eq!(
        m.write_slots().collect::<Vec<_>>(),
        vec![20, 21, 22, 23, 24]
    );
    let reads = m.commit(id).unwrap();
    assert_eq!(reads.entries()[0].num_cached_tokens, 4);
    assert_eq!(reads.num_rows(), 9);
    // A hit shorter than a block reads nothing and recomputes everything.
    let id = plan(&mut m, vec![start("c", &[8], 3, 1)]);
    let p = m.planned()[0];
    assert_eq!((p.compute_start, p.num_tokens, p.read), (0, 4, false));
    m.commit(id).unwrap();
}

#[test]
fn fresh_block_ids_turn_hit_blocks_into_misses() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3], 0, 4)]);
    // An external load reuses block 3 for b: vLLM reports it in new_block_ids_to_zero.
    let id = m
        .plan_step(&StepInput {
            finished_req_ids: vec!["a"],
            scheduled: vec![start("b", &[3, 6], 4, 1)],
            fresh_block_ids: Some(&[3, 6]),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(m.commit(id).unwrap().misses(), &[0]);
}

#[test]
fn resumed_request_replaces_its_table() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3, 7], 0, 6)]);
    let (slots, reads) = step(&mut m, vec![start("a", &[3, 2], 4, 3)]);
    assert_eq!(slots, vec![8, 9, 10]);
    assert_eq!(m.block_table("a").unwrap(), &[3, 2]);
    assert_eq!(reads.entries()[0].num_tokens, 7);
}

#[test]
fn bad_input_leaves_the_mirror_unchanged() {
    // One piece: each bad input lines up with its expected error kind in two parallel
    // lists, and the mirror's state is compared once after all of them.
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3], 0, 4)]);
    let before = (m.step_id(), m.block_state(3).unwrap(), m.num_requests());
    let mut external = start("b", &[3, 4], 4, 1);
    external.assignment = Assignment::Start {
        block_ids: &[3, 4],
        num_computed_tokens: 4,
        num_external_tokens: 5,
        num_prompt_tokens: None,
    };
    let bad: Vec<StepInput<'_>> = vec![
        StepInput {
            scheduled: vec![cont("x", &[], 1)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[3, 10], 0, 5)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[4], 0, 5)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[0], 0, 1)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[4], 0, 1), start("b", &[5], 0, 1)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![cont("a", &[], 1), cont("a", &[], 1)],
            ..Default::default()
        },
        StepInput {
            finished_req_ids: vec!["a"],
            scheduled: vec![start("b", &[3, 4], 0, 5), cont("a", &[], 1)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![cont("a", &[5], usize::MAX)],
            fresh_block_ids: Some(&[3]),
            ..Default::default()
        },
        StepInput {
            scheduled: vec![external],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[4], 0, 1)],
            connector_versions: &[(12, 0)],
            ..Default::default()
        },
        StepInput {
            scheduled: vec![start("b", &[4], 0, 0)],
            prefill_skip: Some(PrefillSkipRequest::default()),
            ..Default::default()
        },
    ];
    let kinds: Vec<_> = bad
        .iter()
        .map(|input| m.plan_step(input).unwrap_err().kind())
        .collect();
    assert_eq!(
        kinds,
        vec![
            K::UnknownRequest,
            K::BlockIdOutOfRange,
            K::InvalidArgument,
            K::InvalidArgument,
            K::InvalidArgument,
            K::InvalidArgument,
            K::UnknownRequest,
            K::InvalidArgument,
            K::InvalidArgument,
            K::BlockIdOutOfRange,
            K::InvalidArgument,
        ]
    );
    assert_eq!(
        (m.step_id(), m.block_state(3).unwrap(), m.num_requests()),
        before
    );
    assert_eq!(m.block_table("a").unwrap(), &[3]);
    let stale = StepRef {
        mirror_id: m.id(),
        step_id: 7,
    };
    assert_eq!(m.commit(stale).unwrap_err().kind(), K::InvalidArgument);
}

#[test]
fn plans_and_reads_of_another_mirror_are_rejected() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    let mut other = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3], 0, 4)]);
    // Two mirrors that advance together have the same step numbers.
    let theirs = plan(&mut other, vec![start("z", &[5], 0, 4)]);
    let ours = plan(&mut m, vec![start("b", &[3, 6], 4, 1)]);
    assert_eq!(theirs.step_id, ours.step_id - 1);
    let theirs = plan(&mut other, vec![start("y", &[6], 0, 4)]);
    assert_eq!(theirs.step_id, ours.step_id);
    assert_eq!(m.commit(theirs).unwrap_err().kind(), K::InvalidArgument);
    assert_eq!(m.pending_step(), Some(ours));
    let mut reads = m.commit(ours).unwrap();
    assert_eq!(
        other.revalidate(&mut reads).unwrap_err().kind(),
        K::InvalidArgument
    );
}

#[test]
fn an_impossible_allocation_is_an_error_not_an_abort() {
    let e = SlotMirror::new(u32::MAX, 1 << 32).unwrap_err();
    assert_eq!(e.kind(), K::InvalidArgument);
    // 2^32 - 1 blocks need 64 GiB of block state: refused or granted lazily, never an
    // abort (a zeroed allocation does not touch its pages).
    match SlotMirror::new(u32::MAX, 16) {
        Ok(m) => assert_eq!(m.block_state(u32::MAX - 1).unwrap(), (0, 0)),
        Err(e) => assert_eq!(e.kind(), K::OutOfMemory),
    }
    assert_eq!(
        zeroed_vec::<u64>(usize::MAX / 4, "test")
            .unwrap_err()
            .kind(),
        K::OutOfMemory
    );
}

#[test]
fn connector_loaded_blocks_are_distrusted_unless_vouched() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    step(&mut m, vec![start("a", &[3, 4], 0, 8)]);
    let (version, rows) = m.block_state(4).unwrap();
    assert_eq!(rows, 4);
    let loaded = |id: &'static str, blocks: &'static [BlockId]| ScheduledRequest {
        req_id: id,
        assignment: Assignment::Start {
            block_ids: blocks,
            num_computed_tokens: 8,
            num_external_tokens: 4,
            num_prompt_tokens: None,
        },
        num_scheduled_tokens: 1,
    };
    // b's hit: block 3 local, block 4 loaded by a connector (no version): a miss.
    let id = m
        .plan_step(&StepInput {
            scheduled: vec![loaded("b", &[3, 4, 6])],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(m.commit(id).unwrap().misses(), &[0]);
    assert_eq!(m.stats().untrusted_loaded_blocks, 1);
    assert_eq!(m.block_state(4).unwrap(), (version + 1, 0));
    // a writes block 4 again; c's connector vouches for the current version: served.
    step(&mut m, vec![start("a2", &[3, 4], 4, 4)]);
    let current = m.block_state(4).unwrap().0;
    let id = m
        .plan_step(&StepInput {
            scheduled: vec![loaded("c", &[3, 4, 7])],
            connector_versions: &[(4, current)],
            ..Default::default()
        })
        .unwrap();
    let reads = m.commit(id).unwrap();
    assert_eq!(reads.entries().len(), 1, "{reads:?}");
    assert_eq!(m.stats().vouched_blocks, 1);
    // A version that is no longer the block's is ignored: the load is distrusted.
    let id = m
        .plan_step(&StepInput {
            scheduled: vec![loaded("d", &[3, 4, 8])],
            connector_versions: &[(4, current - 1)],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(m.commit(id).unwrap().misses(), &[0]);
}

#[test]
fn skip_layer_rows_are_written_only_for_kept_tokens() {
    let mut m = SlotMirror::new(10, 4).unwrap();
    // A 9-token prompt sampled at its end under fast prefill: the skip layers compute
    // only its last token.
    let mut a = start("a", &[3, 4, 5], 0, 9);
    a.assignment = Assignment::Start {
        block_ids: &[3, 4, 5],
        num_computed_tokens: 0,
        num_external_tokens: 0,
        num_prompt_tokens: Some(9),
    };
    let id = m
        .plan_step(&StepInput {
            scheduled: vec![a],
            prefill_skip: Some(PrefillSkipRequest::default()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(m.planned()[0].kept, 1);
    assert_eq!(m.kept_write_slots().collect::<Vec<_>>(), vec![20]);
    let skip = m.pending_prefill_skip().unwrap();
    assert_eq!((skip.num_logits, skip.logits_indices.clone()), (1, vec![8]));
    m.commit(id).unwrap();
    assert_eq!(m.block_state(3).unwrap().1, 4);
    assert_eq!(m.block_skip_rows(3).unwrap(), 0);
    assert_eq!(m.stats().skipped_rows, 8);
    // b hits a's two full blocks: served for the keys of every layer, not the skip
    // layers' (their rows were never computed).
    let (_, reads) = step(&mut m, vec![start("b", &[3, 4, 6], 8, 1)]);
    assert_eq!(reads.entries().len(), 1);
    assert!(!reads.entries()[0].skip_layers);
    assert_eq!(m.stats().partial_reads, 1);
    // Without fast prefill every key is written: a later hit is whole.
    step(&mut m, vec![start("c", &[7], 0, 4)]);
    let (_, reads) = step(&mut m, vec![start("d", &[7, 8], 4, 1)]);
    assert!(reads.entries()[0].skip_layers);
}

// ---- regressions: vllm-omni's hidden-state prefix cache bugs ------------------------

/// Each scenario returns whether the mirror served a row it must not serve.
type Scenario = fn(&mut SlotMirror) -> bool;

/// A hit on a block written in the same step read zeros (the rows landed after the
/// read): here the read must see the step's own writes.
fn same_step_hit(m: &mut SlotMirror) -> bool {
    // b is planned before a, yet a's writes of this step must validate b's read.
    let (_, reads) = step(
        m,
        vec![start("b", &[3, 6], 4, 1), start("a", &[3, 7], 0, 8)],
    );
    reads.entries().len() != 1
}

/// An aborted request's blocks stayed hittable although their rows were never
/// completed: its step is planned, never committed, then b hits its blocks.
fn aborted_request(m: &mut SlotMirror) -> bool {
    plan(m, vec![start("a", &[3, 4], 0, 8)]);
    let id = m
        .plan_step(&StepInput {
            finished_req_ids: vec!["a"],
            scheduled: vec![start("b", &[3, 4, 6], 8, 1)],
            ..Default::default()
        })
        .unwrap();
    !m.commit(id).unwrap().entries().is_empty()
}

/// A block evicted and reused served the previous owner's rows.
fn evicted_and_reused(m: &mut SlotMirror) -> bool {
    step(m, vec![start("a", &[3], 0, 4)]);
    // a finishes; block 3 is evicted and goes to c as a fresh block; c writes 2 rows.
    let id = m
        .plan_step(&StepInput {
            finished_req_ids: vec!["a"],
            scheduled: vec![start("c", &[3], 0, 2)],
            ..Default::default()
        })
        .unwrap();
    m.commit(id).unwrap();
    // A claim on block 3 (a's old content) must not get a's or c's rows.
    let (_, reads) = step(m, vec![start("b", &[3, 6], 4, 1)]);
    !reads.entries().is_empty()
}

/// A delayed read returned the new occupant's rows after the block was reused and
/// fully rewritten.
fn delayed_read_after_reuse(m: &mut SlotMirror) -> bool {
    step(m, vec![start("a", &[3], 0, 4)]);
    let (_, mut reads) = step(m, vec![start("b", &[3, 6], 4, 1)]);
    let id = m
        .plan_step(&StepInput {
            finished_req_ids: vec!["a", "b"],
            scheduled: vec![start("c", &[3], 0, 4)],
            ..Default::default()
        })
        .unwrap();
    m.commit(id).unwrap();
    m.revalidate(&mut reads).unwrap();
    !reads.entries().is_empty()
}

/// A connector-loaded block was trusted without a version check.
fn connector_loaded(m: &mut SlotMirror) -> bool {
    step(m, vec![start("a", &[3, 4], 0, 8)]);
    let id = m
        .plan_step(&StepInput {
            finished_req_ids: vec!["a"],
            scheduled: vec![ScheduledRequest {
                req_id: "b",
                assignment: Assignment::Start {
                    block_ids: &[3, 4, 6],
                    num_computed_tokens: 8,
                    num_external_tokens: 8,
                    num_prompt_tokens: None,
                },
                num_scheduled_tokens: 1,
            }],
            ..Default::default()
        })
        .unwrap();
    !m.commit(id).unwrap().entries().is_empty()
}

/// Fast prefill skipped a prompt's tokens in the skip layers; a hit must not serve
/// those layers' rows.
fn skipped_prefill_rows(m: &mut SlotMirror) -> bool {
    let id = m
        .plan_step(&StepInput {
            scheduled: vec![start("a", &[3, 4], 0, 8)],
            prefill_skip: Some(PrefillSkipRequest::default()),
            ..Default::default()
        })
        .unwrap();
    m.commit(id).unwrap();
    let (_, reads) = step(m, vec![start("b", &[3, 6], 4, 1)]);
    reads.entries().iter().any(|e| e.skip_layers)
}

#[test]
fn each_reported_bug_is_caught_and_would_fail_on_a_broken_mirror() {
    let cases: [(&str, Scenario, Faults); 6] = [
        (
            "same-step hit",
            same_step_hit,
            Faults {
                reads_before_writes: true,
                ..Default::default()
            },
        ),
        (
            "aborted request",
            aborted_request,
            Faults {
                uncommitted_written: true,
                ..Default::default()
            },
        ),
        (
            "evicted and reused block",
            evicted_and_reused,
            Faults {
                no_bump: true,
                ..Default::default()
            },
        ),
        (
            "delayed read after reuse",
            delayed_read_after_reuse,
            Faults {
                no_bump: true,
                ..Default::default()
            },
        ),
        (
            "connector-loaded block",
            connector_loaded,
            Faults {
                trust_connector: true,
                ..Default::default()
            },
        ),
        (
            "skipped prefill rows",
            skipped_prefill_rows,
            Faults {
                ignore_skip: true,
                ..Default::default()
            },
        ),
    ];
    for (name, scenario, faults) in cases {
        let mut good = SlotMirror::new(10, 4).unwrap();
        assert!(!scenario(&mut good), "{name}: the mirror served a bad row");
        let mut broken = SlotMirror::new(10, 4).unwrap().with_faults(faults);
        assert!(
            scenario(&mut broken),
            "{name}: the broken mirror was not caught"
        );
    }
}

/// Random traces against a naive model: every served read covers rows written
/// after the last fresh assignment of their block, and reads are refused only
/// when some row was not.
#[test]
fn random_traces_match_a_naive_model() {
    // One piece: the mirror and the naive model (`gen`, `ok`, `tables`) advance together
    // in one loop, each step's assertions reading both.
    let mut rng: u64 = 0x1234_5678;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let bs = 4;
    let mut m = SlotMirror::new(16, bs).unwrap();
    // Naive model: per slot, the version of its current occupant and whether it was
    // written in it.
    let mut gen = [0u64; 16];
    let mut ok = vec![false; 16 * bs];
    let mut tables: FxHashMap<String, Vec<BlockId>> = FxHashMap::default();
    for s in 0..400 {
        let rid = format!("r{s}");
        let nblocks = 1 + next(3);
        let donor = tables.values().next().cloned();
        let mut table: Vec<BlockId> = Vec::new();
        let mut hit = 0;
        if let Some(d) = donor.filter(|_| next(2) == 0) {
            let k = next(d.len() + 1);
            table.extend_from_slice(&d[..k]);
            hit = k * bs;
        }
        let target = nblocks.max(table.len() + 1);
        while table.len() < target {
            table.push(1 + next(15) as BlockId);
        }
        let fresh: Vec<BlockId> = table[hit / bs..].to_vec();
        if fresh.iter().any(|b| table[..hit / bs].contains(b))
            || fresh
                .iter()
                .enumerate()
                .any(|(i, b)| fresh[..i].contains(b))
        {
            continue;
        }
        let n = 1 + next(table.len() * bs - hit);
        let commit = next(5) != 0;
        let id = m
            .plan_step(&StepInput {
                finished_req_ids: tables.keys().map(std::string::String::as_str).collect(),
                scheduled: vec![start(&rid, &table, hit, n)],
                ..Default::default()
            })
            .unwrap();
        for &b in &fresh {
            gen[b as usize] += 1;
            for r in 0..bs {
                ok[b as usize * bs + r] = false;
            }
        }
        tables.clear();
        if !commit {
            continue;
        }
        for pos in hit..hit + n {
            let b = table[pos / bs] as usize;
            // leading rows only
            if pos % bs == 0 || ok[b * bs + pos % bs - 1] {
                ok[b * bs + pos % bs] = true;
            }
        }
        let reads = m.commit(id).unwrap();
        let want_read = hit > 0;
        let valid = (0..hit + n).all(|pos| ok[table[pos / bs] as usize * bs + pos % bs]);
        if want_read {
            assert_eq!(reads.entries().len() == 1, valid, "step {s}");
            assert_eq!(reads.misses().len() == 1, !valid, "step {s}");
        } else {
            assert!(reads.entries().is_empty() && reads.misses().is_empty());
        }
        for &b in &table {
            assert_eq!(m.block_state(b).unwrap().0, gen[b as usize]);
        }
        tables.insert(rid, table);
    }
    let st = m.stats();
    assert!(st.reads_served > 20 && st.read_misses > 20, "{st:?}");
    assert!(st.uncommitted_steps > 20, "{st:?}");
}

/// Random chunked prefills and decodes of several requests, blocks appended as they
/// fill: every step's write slots equal a naive table's, and every block's written
/// count is the number of its leading rows written since its assignment.
#[test]
fn random_continuations_match_a_naive_table() {
    // Powers of two take the shift path, other sizes (hybrid models) the division.
    for bs in [4, 6, 16] {
        random_continuations(bs);
    }
}

fn random_continuations(bs: usize) {
    let mut rng: u64 = 0x9e37_79b9;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let mut m = SlotMirror::new(8192, bs).unwrap();
    let mut free: Vec<BlockId> = (1..8192).rev().collect();
    // (id, table, position, started)
    let mut live: Vec<(String, Vec<BlockId>, usize, bool)> = Vec::new();
    let mut rows = vec![0u32; 8192];
    for s in 0..1500 {
        if live.len() < 6 && next(3) == 0 {
            live.push((format!("r{s}"), Vec::new(), 0, false));
        }
        let mut news: Vec<(usize, Vec<BlockId>)> = Vec::new();
        let mut want: Vec<i64> = Vec::new();
        for (_, table, pos, _) in live.iter_mut() {
            let n = if next(3) == 0 { 1 + next(9) } else { 1 };
            let mut new = Vec::new();
            while table.len() * bs < *pos + n {
                let b = free.pop().unwrap();
                table.push(b);
                new.push(b);
                rows[b as usize] = 0;
            }
            for p in *pos..*pos + n {
                let b = table[p / bs] as usize;
                want.push((b * bs + p % bs) as i64);
                rows[b] = rows[b].max((p % bs + 1) as u32);
            }
            *pos += n;
            news.push((n, new));
        }
        let scheduled = live
            .iter()
            .zip(&news)
            .map(|((id, table, _, started), (n, new))| {
                if *started {
                    cont(id, new, *n)
                } else {
                    start(id, table, 0, *n)
                }
            })
            .collect();
        let (slots, _) = step(&mut m, scheduled);
        assert_eq!(slots, want, "step {s}");
        for (_, table, _, started) in live.iter_mut() {
            *started = true;
            for &b in table.iter() {
                assert_eq!(
                    m.block_state(b).unwrap().1 as u32,
                    rows[b as usize],
                    "step {s}"
                );
            }
        }
        if next(8) == 0 && !live.is_empty() {
            let (id, table, _, _) = live.remove(next(live.len()));
            let id_ref: &str = &id;
            let done = m
                .plan_step(&StepInput {
                    finished_req_ids: vec![id_ref],
                    ..Default::default()
                })
                .unwrap();
            m.commit(done).unwrap();
            free.extend(table);
        }
    }
}
