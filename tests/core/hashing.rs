//! Block hashing without Python: golden values from vLLM 0.33 and properties.
//!
//! The golden hashes were computed with `vllm.v1.core.kv_cache_utils.hash_block_tokens`
//! and `vllm.utils.hashing` (PYTHONHASHSEED=golden); `tests/hashing/test_block_hasher.py`
//! checks the same functions live on thousands of random requests.
//!
//! Properties:
//! - for items sorted and non-overlapping, vLLM's incremental multimodal scan (driven
//!   by the request hasher, with and without lookahead) yields exactly the items that
//!   overlap each block, with offsets relative to the block start;
//! - hashing a request's tokens in arbitrary increments yields the one-shot hashes;
//! - the pickle writer emits a frame structure that parses back to the input length.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use hscache::extra_keys::{
    gen_mm_extra_hash_keys, generate_lookahead_block_hash_extra_keys, initial_mm_index,
    BlockExtras, ExtraKey, ExtraKeysForm, MmFeature, RequestExtraKeys, TagIds,
};
use hscache::hash::request::{RequestBlockHasher, RequestHashInput};
use hscache::hash::value::{Atom, ObjId, ValueSeq};
use hscache::hash::{none_hash, BlockHasher, HashAlgo, Serialization};
use hscache::types::BlockHash;
use proptest::prelude::*;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn s(text: &str) -> Atom<'_> {
    Atom::Str(text, ObjId::UNIQUE)
}

const DIGEST: [u8; 32] = {
    let mut d = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        d[i] = i as u8;
        i += 1;
    }
    d
};

/// (algo, NONE_HASH for seed "golden", the chain of the four blocks of `golden_blocks`).
const GOLDEN: [(HashAlgo, &str, [&str; 4]); 4] = [
    (
        HashAlgo::Sha256,
        "fb591d55adfb5f6c2e63b08c14760ba9c2c481d7fecadc20d142d7ea9f075b1c",
        [
            "ffd04d068a777e7949268b4ebf86baa081dd6df823e75f023e9ae9df287438d6",
            "3eb978c0042fef958307ca7dd38c40a7a74e422490f48408b8af6140ff388d3c",
            "c371fd366f53a05f31f9ca4bd06ad1581a32ea0861bc9012026c0adbcb5942ef",
            "998c68b777c62ae893500a0c7a80cdbd717b187580538f8e4a6c4afb8b17b9a9",
        ],
    ),
    (
        HashAlgo::Sha256Cbor,
        "ae5c829657cac4bb73864979a1ead9bd99c8919db26a806b7632fc38ebe73cea",
        [
            "b7a8d66bedec577d7e33d11694411c297a213c4f4c8eac66a9205c67780cb8eb",
            "33b2e442f7b05414a69b520ddf2aa3c5c54b4a5010071cc20a9dff439c222330",
            "315500c0a553eb2a01ba41e3ff377c8fac9b8e5a72a7feea7d0df3a059eed6a5",
            "5040a405163657870466fe1d4d0a9b0e24d0bab26feaab209aa58f7a4ced17a8",
        ],
    ),
    (
        HashAlgo::Xxhash,
        "f833a389b3652917901ca2606a51deaa",
        [
            "9b6e32af5885e11029012ec7da5d4a7d",
            "971b0d5248704d66c3c962227344605d",
            "782d412829bf604a2d4ae70a8ab700a2",
            "cf508b789460c4bf85c6e49baaa9d6fd",
        ],
    ),
    (
        HashAlgo::XxhashCbor,
        "a5b2012f40b6baa51af6e24eece9f237",
        [
            "5306b695dd7e011797a7ca555d2d0c1e",
            "deb4e1cdf6c037ea71d723c74c029fa6",
            "00fd20855c76c348af72a42ce8737f9d",
            "311ede5561e4a14386d547886b24f7ed",
        ],
    ),
];

/// The four golden blocks: (tokens, extra keys, lookahead tokens).
fn golden_blocks() -> Vec<(Vec<u32>, Vec<ExtraKey<'static>>, Vec<u32>)> {
    let lora = ExtraKey::Lora {
        name: s("adapter"),
        path: s("/adapters/a"),
    };
    vec![
        (
            (1..=16).collect(),
            vec![
                lora,
                ExtraKey::Mm {
                    identifier: s("img-1"),
                    offset: 3,
                },
                ExtraKey::CacheSalt(s("tenant")),
            ],
            vec![],
        ),
        (
            [
                70000,
                255,
                256,
                65535,
                65536,
                (1 << 31) - 1,
                1 << 31,
                u32::MAX,
            ]
            .repeat(2),
            vec![],
            vec![],
        ),
        (
            vec![5; 16],
            vec![
                lora,
                ExtraKey::Mm {
                    identifier: s("img-1"),
                    offset: -13,
                },
                ExtraKey::Mm {
                    identifier: s("img-2"),
                    offset: 2,
                },
                ExtraKey::PromptEmbeds(DIGEST),
            ],
            vec![],
        ),
        (vec![7; 16], vec![lora], vec![99, 100]),
    ]
}

#[test]
fn every_vllm_algorithm_matches_golden_values() {
    let tags = TagIds::default();
    for (algo, root, chain) in GOLDEN {
        let root_hash = none_hash(algo, "golden");
        assert_eq!(hex(root_hash.as_bytes()), root, "{algo:?} NONE_HASH");
        let mut h = BlockHasher::new(algo);
        let mut parent = root_hash;
        for (i, (tokens, keys, lookahead)) in golden_blocks().iter().enumerate() {
            let extras = BlockExtras {
                keys,
                lookahead,
                tags: &tags,
                form: ExtraKeysForm::Tagged,
            };
            parent = h.hash_block(parent.as_bytes(), tokens, &extras);
            assert_eq!(hex(parent.as_bytes()), chain[i], "{algo:?} block {i}");
        }
    }
}

#[test]
fn pickle_memo_follows_object_identity() {
    // ("mm", ident, 0), ("mm", ident, 1) with one object vs two equal objects.
    let same = "4594ad6dc42f4fcd6a65b76f5102788e304748149a72e300a2d50342326e9430";
    let diff = "c395991c1ce21a962065366390807c7465dcae942a3fdbf6b962cd1c751e31e3";
    let root = none_hash(HashAlgo::Sha256, "golden");
    let tags = TagIds::default();
    let mut h = BlockHasher::new(HashAlgo::Sha256);
    for (id_a, id_b, want) in [(7, 7, same), (7, 8, diff), (0, 0, diff)] {
        let keys = [
            ExtraKey::Mm {
                identifier: Atom::Str("shared-id", ObjId::new(id_a)),
                offset: 0,
            },
            ExtraKey::Mm {
                identifier: Atom::Str("shared-id", ObjId::new(id_b)),
                offset: 1,
            },
        ];
        let extras = BlockExtras {
            keys: &keys,
            lookahead: &[],
            tags: &tags,
            form: ExtraKeysForm::Tagged,
        };
        let got = h.hash_block(root.as_bytes(), &[1, 2], &extras);
        assert_eq!(hex(got.as_bytes()), want, "ids {id_a} {id_b}");
    }
}

#[test]
fn serializers_match_python_bytes() {
    // pickle.dumps((b"\x01\x02", (1, 300, 70000, -5, 2**40), ("mm", "x", None, ())), protocol=5)
    let pickle = "80059530000000000000004302010294284b014d2c014a701101004afbffffff8a06000000\
                  0000017494288c026d6d948c0178944e29749487942e";
    // cbor2.dumps((b"\x01\x02", (1, 300, 70000, -5, 2**40, 2**64, -2**64 - 1),
    //              ("mm", "x", None, ())), canonical=True)
    let cbor = "83420102870119012c1a00011170241b0000010000000000c249010000000000000000c349\
                01000000000000000084626d6d6178f680";
    let ints: &[i128] = &[1, 300, 70000, -5, 1 << 40, 1 << 64, -(1 << 64) - 1];
    for (format, n, want) in [
        (Serialization::Pickle, 5, pickle),
        (Serialization::Cbor, 7, cbor),
    ] {
        let mut v = ValueSeq::new();
        let root = v.open_tuple(3, ObjId::UNIQUE);
        v.push_atom(Atom::Bytes(&[1, 2], ObjId::UNIQUE));
        let t = v.open_tuple(n, ObjId::UNIQUE);
        for &i in &ints[..n] {
            v.push_atom(Atom::Int(i));
        }
        v.close_tuple(t);
        let k = v.open_tuple(4, ObjId::UNIQUE);
        v.push_atom(Atom::Str("mm", ObjId::new(1)));
        v.push_atom(s("x"));
        v.push_atom(Atom::None);
        let e = v.open_tuple(0, ObjId::UNIQUE);
        v.close_tuple(e);
        v.close_tuple(k);
        v.close_tuple(root);
        let mut h = BlockHasher::new(HashAlgo::Sha256);
        let bytes = h.serialize(format, &v).expect("well-formed value");
        assert_eq!(hex(bytes), want.replace(' ', ""), "{format:?}");
    }
}

#[test]
fn malformed_value_sequences_are_rejected() {
    let mut v = ValueSeq::new();
    v.open_tuple(2, ObjId::UNIQUE);
    v.push_atom(Atom::None);
    let mut h = BlockHasher::new(HashAlgo::Sha256);
    assert!(h.hash_value(&v).is_err(), "tuple missing an item");
    let mut two_roots = ValueSeq::new();
    two_roots.push_atom(Atom::None);
    two_roots.push_atom(Atom::None);
    assert!(h.hash_value(&two_roots).is_err());
}

#[test]
fn large_blocks_split_pickle_frames_like_cpython() {
    // 20000 five-byte ints: CPython commits the first frame at exactly 65536 bytes.
    let tokens: Vec<u32> = (70_000..90_000).collect();
    let mut v = ValueSeq::new();
    let root = v.open_tuple(3, ObjId::UNIQUE);
    v.push_atom(Atom::Bytes(&[b'x'; 32], ObjId::UNIQUE));
    let t = v.open_tuple(tokens.len(), ObjId::UNIQUE);
    for &x in &tokens {
        v.push_atom(Atom::Int(i128::from(x)));
    }
    v.close_tuple(t);
    v.push_atom(Atom::None);
    v.close_tuple(root);
    let mut h = BlockHasher::new(HashAlgo::Sha256);
    let bytes = h
        .serialize(Serialization::Pickle, &v)
        .expect("valid")
        .to_vec();
    let mut frames = Vec::new();
    let mut i = 2;
    while i < bytes.len() && bytes[i] == 0x95 {
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[i + 1..i + 9]);
        let n = u64::from_le_bytes(len) as usize;
        frames.push(n);
        i += 9 + n;
    }
    assert_eq!(i, bytes.len());
    assert_eq!(frames, vec![65536, 34506]);
}

/// Sorted, non-overlapping items: (offset, length) with gaps.
fn features_strategy() -> impl Strategy<Value = Vec<(usize, usize)>> {
    proptest::collection::vec((0usize..6, 0usize..20), 0..8).prop_map(|gaps| {
        let mut pos = 0;
        gaps.into_iter()
            .map(|(gap, len)| {
                let f = (pos + gap, len);
                pos += gap + len;
                f
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// vLLM's incremental scan == "every item overlapping the block", for sorted,
    /// non-overlapping items, from any first block and with lookahead.
    #[test]
    fn mm_scan_equals_overlap_model(
        spans in features_strategy(),
        bs in 1usize..12,
        first_block in 0usize..4,
        lookahead in 0usize..3,
        num_blocks in 1usize..12,
    ) {
        let names: Vec<String> = (0..spans.len()).map(|i| format!("item-{i}")).collect();
        let features: Vec<MmFeature<'_>> = spans
            .iter()
            .zip(&names)
            .map(|(&(o, l), n)| MmFeature::new(o, l, s(n)).expect("valid"))
            .collect();
        let req = RequestExtraKeys { mm_features: &features, ..Default::default() };
        let mut idx = initial_mm_index(&features, first_block * bs);
        let mut out = Vec::new();
        for b in first_block..first_block + num_blocks {
            let (start, end) = (b * bs, (b + 1) * bs);
            let hash_end = end + lookahead;
            idx = generate_lookahead_block_hash_extra_keys(
                &req, start, end, hash_end, idx, None, &mut out,
            ).expect("valid");
            let want: Vec<ExtraKey<'_>> = features
                .iter()
                .filter(|f| f.offset() < hash_end && f.end() > start)
                .map(|f| ExtraKey::Mm { identifier: f.identifier(), offset: f.offset() as i64 - start as i64 })
                .collect();
            prop_assert_eq!(&out, &want, "block [{}, {}) + {}", start, end, lookahead);
        }
        // The plain scan (no lookahead) agrees with the same model.
        let mut plain = Vec::new();
        gen_mm_extra_hash_keys(&features, 0, bs, 0, &mut plain).expect("valid");
        let want: Vec<ExtraKey<'_>> = features
            .iter()
            .filter(|f| f.offset() < bs && f.end() > 0)
            .map(|f| ExtraKey::Mm { identifier: f.identifier(), offset: f.offset() as i64 })
            .collect();
        prop_assert_eq!(plain, want);
    }

    /// Hashing in arbitrary increments (tokens appended a few at a time, as decode
    /// does) yields the one-shot hashes, for every algorithm and lookahead.
    #[test]
    fn incremental_hashing_equals_one_shot(
        tokens in proptest::collection::vec(any::<u32>(), 0..200),
        steps in proptest::collection::vec(1usize..9, 1..60),
        bs in 1usize..17,
        lookahead in 0usize..3,
        salted in any::<bool>(),
    ) {
        let features = [MmFeature::new(3, 11, s("image")).expect("valid")];
        let keys = RequestExtraKeys {
            lora: None,
            mm_features: &features,
            cache_salt: salted.then(|| s("salt")),
        };
        for algo in HashAlgo::ALL {
            let root = none_hash(algo, "seed");
            let mut h = RequestBlockHasher::new(algo, bs, lookahead).expect("valid");
            let hash_upto = |h: &mut RequestBlockHasher, n: usize, hashed: &[BlockHash]| {
                let input = RequestHashInput {
                    num_hashed_blocks: hashed.len(),
                    parent: hashed.last().map(hscache::types::BlockHash::as_bytes),
                    none_hash: root.as_bytes(),
                    tokens: &tokens[(hashed.len() * bs).min(n)..n],
                    keys,
                    prompt_embeds_digests: None,
                };
                let mut new = Vec::new();
                h.hash_new_blocks(&input, &mut new).expect("ok");
                new
            };
            let all = hash_upto(&mut h, tokens.len(), &[]);
            let mut inc: Vec<BlockHash> = Vec::new();
            let mut n = 0;
            for step in steps.iter().cycle() {
                if n >= tokens.len() {
                    break;
                }
                n = (n + step).min(tokens.len());
                let new = hash_upto(&mut h, n, &inc);
                inc.extend(new);
            }
            prop_assert_eq!(&all, &inc, "{:?}", algo);
            prop_assert_eq!(all.len(), tokens.len().saturating_sub(lookahead) / bs);
        }
    }
}
