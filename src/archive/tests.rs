//! Builder/reader round trips and corruption checks (no Python).

use std::io::Cursor;

use super::value::ArchivedValue;
use super::*;

fn record(i: i64) -> Value {
    Value::Dict(vec![
        Value::Sym(0),
        Value::Int(i),
        Value::Str("name".into()),
        Value::List(vec![
            Value::Float(1.5),
            Value::Str(format!("r{i}")),
            Value::None,
        ]),
    ])
}

fn build_list(n: i64) -> Vec<u8> {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
    assert_eq!(b.intern("id"), Some(0));
    for i in 0..n {
        b.finish_record(&record(i)).unwrap();
    }
    let (out, len) = b.finish(0).unwrap();
    let bytes = out.into_inner();
    assert_eq!(bytes.len() as u64, len);
    bytes
}

#[test]
fn list_roundtrip() {
    let bytes = build_list(100);
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(r.len(), 100);
    assert_eq!(r.kind(), Kind::List);
    for i in 0..100 {
        let node = r.root(i).unwrap();
        let ArchivedValue::Dict(items) = r.get(node) else {
            panic!("not a dict")
        };
        assert_eq!(r.value_key(&items[0]).unwrap(), Key::Str("id".into()));
        match &items[1] {
            ArchivedValue::Int(v) => assert_eq!(v.to_native(), i as i64),
            _ => panic!("not an int"),
        }
        let found = r.dict_find(items, &[], &Key::Str("name".into())).unwrap();
        assert_eq!(found, Some(1));
        assert_eq!(r.dict_find_str(items, &[], "id").unwrap(), Some(0));
        let child = r.child(node, &items[3]);
        assert_eq!(r.node_checked(i, child.pos()).unwrap(), child);
    }
    r.validate_all().unwrap();
}

#[test]
fn dict_archive_lookup() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Dict, 1).unwrap();
    for i in 0..1000i64 {
        b.add_key(&Key::Str(format!("doc-{i}").into())).unwrap();
        b.finish_record(&Value::Int(i * 2)).unwrap();
    }
    b.add_key(&Key::Int(7)).unwrap();
    b.finish_record(&Value::None).unwrap();
    let bytes = b.finish(0).unwrap().0.into_inner();
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(r.lookup(&Key::Str("doc-500".into())).unwrap(), Some(500));
    assert_eq!(r.lookup(&Key::Str("doc-1000".into())).unwrap(), None);
    assert_eq!(r.lookup(&Key::Float(7.0)).unwrap(), Some(1000));
    assert_eq!(r.key(3).unwrap(), Key::Str("doc-3".into()));
}

#[test]
fn duplicate_key_rejected_before_write() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Dict, 1).unwrap();
    b.add_key(&Key::Int(1)).unwrap();
    b.finish_record(&Value::None).unwrap();
    assert!(matches!(
        b.add_key(&Key::Bool(true)),
        Err(ArchiveError::DuplicateKey(0))
    ));
}

#[test]
fn truncation_is_corrupt() {
    let bytes = build_list(10);
    for cut in [0, 1, 64, 127, 128, 200, bytes.len() - 1] {
        assert!(Reader::open(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn unsealed_is_refused() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
    b.finish_record(&Value::None).unwrap();
    // Not finished: the placeholder header is still there.
    let mut bytes = vec![0u8; 256];
    bytes[..8].copy_from_slice(&header::UNSEALED_MAGIC);
    assert!(matches!(
        Reader::open(&bytes[..]),
        Err(ArchiveError::Unsealed)
    ));
}

/// Every single-byte corruption is detected by open() or by the first access of the
/// record it hits; none panics.
#[test]
fn every_byte_flip_is_detected() {
    let bytes = build_list(3);
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        let detected = match Reader::open(&b[..]) {
            Err(_) => true,
            Ok(r) => (0..r.len()).any(|rec| r.root(rec).is_err()),
        };
        // Padding bytes between spans are not covered by any checksum.
        let in_padding = {
            let r = Reader::open(&bytes[..]).unwrap();
            let mut covered = i < header::HEADER_LEN || i >= r.header().index_off as usize;
            for rec in 0..r.len() {
                let n = r.root(rec).unwrap();
                let _ = n;
            }
            let idx = r.header().index_off as usize;
            for rec in 0..r.len() as usize {
                let at = idx + rec * header::INDEX_ENTRY;
                let s = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
                let e = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap()) as usize;
                covered |= (s..e).contains(&i);
            }
            !covered
        };
        assert!(detected || in_padding, "flip at byte {i} went unnoticed");
    }
}

#[test]
fn arrays_and_payloads() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
    let data: Vec<u8> = (0..80u8).collect();
    let ext = b.write_payload(&data).unwrap();
    let v = Value::Array(Box::new(ArrayMeta {
        typestr: "<f8".into(),
        shape: vec![2, 5],
        data: ext,
    }));
    b.finish_record(&v).unwrap();
    let bytes = b.finish(0).unwrap().0.into_inner();
    let r = Reader::open(&bytes[..]).unwrap();
    let node = r.root(0).unwrap();
    let ArchivedValue::Array(meta) = r.get(node) else {
        panic!()
    };
    let a = r.array(node, meta).unwrap();
    assert_eq!(a.shape, vec![2, 5]);
    assert_eq!(a.offset % 64, 0);
    assert_eq!(&bytes[a.offset..a.offset + a.nbytes], &data[..]);
}

/// Recompute the header checksum after editing metadata (what a forger would do).
fn reseal(bytes: &mut [u8]) {
    let idx = index_off(bytes);
    let sum = header::checksum_parts(&bytes[..120], &bytes[idx..]);
    bytes[120..128].copy_from_slice(&sum.to_le_bytes());
}

fn index_off(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize
}

fn build_dict(n: i64) -> Vec<u8> {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Dict, 1).unwrap();
    for i in 0..n {
        b.add_key(&Key::Str(format!("D{i:08}").into())).unwrap();
        b.finish_record(&Value::Str("x".repeat(i as usize % 3000)))
            .unwrap();
    }
    b.finish(0).unwrap().0.into_inner()
}

fn table_range(bytes: &[u8]) -> (usize, usize) {
    let r = Reader::open(bytes).unwrap();
    (r.header().table_off as usize, r.header().table_len as usize)
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn check_all(r: &Reader<&[u8]>, n: u64) {
    for i in 0..n {
        let key = Key::Str(format!("D{i:08}").into());
        assert_eq!(r.lookup(&key).unwrap(), Some(i));
        let ArchivedValue::Str(s) = r.get(r.root(i).unwrap()) else {
            panic!("not a str")
        };
        assert_eq!(s.len(), i as usize % 3000);
    }
    assert_eq!(r.lookup(&Key::Str("D99999999".into())).unwrap(), None);
}

/// The record hint only steers prefetches: garbage in it (even under a valid checksum)
/// changes no answer. A key hint that is absent or out of range falls back to the keys'
/// offsets.
#[test]
fn table_record_hints_are_only_prefetched() {
    let mut bytes = build_dict(500);
    let (to, len) = table_range(&bytes);
    assert_eq!(len % table::SLOT, 0);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for (n, slot) in bytes[to..to + len].chunks_mut(table::SLOT).enumerate() {
        let key = if n % 2 == 0 { u32::MAX } else { u32::MAX - 7 };
        slot[8..12].copy_from_slice(&key.to_le_bytes());
        slot[12..16].copy_from_slice(&(xorshift(&mut x) as u32).to_le_bytes());
    }
    reseal(&mut bytes);
    check_all(&Reader::open(&bytes[..]).unwrap(), 500);
}

/// Key hints are metadata like the offsets they repeat: a forged one (with a forged checksum)
/// can make a lookup miss or answer another entry, as any forged byte can, but every read
/// stays in bounds and nothing panics.
#[test]
fn forged_key_hints_stay_in_bounds() {
    let mut bytes = build_dict(500);
    let (to, len) = table_range(&bytes);
    let keys_len = Reader::open(&bytes[..]).unwrap().header().keys_len as u32;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for slot in bytes[to..to + len].chunks_mut(table::SLOT) {
        let key = xorshift(&mut x) as u32 % (keys_len + 64);
        slot[8..12].copy_from_slice(&key.to_le_bytes());
    }
    reseal(&mut bytes);
    let r = Reader::open(&bytes[..]).unwrap();
    for i in 0..600u64 {
        let _ = r.lookup(&Key::Str(format!("D{i:08}").into()));
        let _ = r.lookup(&Key::Str("x".repeat(i as usize).into()));
    }
}

/// The builder's hints are right: every slot's key hint is its entry's key offset.
#[test]
fn table_hints_match_the_metadata() {
    let bytes = build_dict(500);
    let r = Reader::open(&bytes[..]).unwrap();
    let (to, len) = table_range(&bytes);
    let h = r.header();
    let (ko, idx) = (h.keys_off as usize, h.index_off as usize);
    let mut seen = 0;
    for slot in bytes[to..to + len].chunks(table::SLOT) {
        let slot = table::Slot::read(slot);
        let Some(e) = slot.entry() else {
            continue;
        };
        seen += 1;
        let e = e as usize;
        let (key, end) = (slot.key as u64, slot.end64 as u64);
        let off = u64::from_le_bytes(bytes[ko + e * 8..ko + e * 8 + 8].try_into().unwrap());
        let span_end = u64::from_le_bytes(
            bytes[idx + e * header::INDEX_ENTRY + 8..idx + e * header::INDEX_ENTRY + 16]
                .try_into()
                .unwrap(),
        );
        assert_eq!(key, off);
        assert_eq!(end, span_end / 64);
    }
    assert_eq!(seen, 500);
}

/// A full table (no empty slot) ends a miss after one round instead of looping.
#[test]
fn missing_key_in_a_full_table_ends() {
    let mut bytes = build_dict(20);
    let (to, len) = {
        let r = Reader::open(&bytes[..]).unwrap();
        (r.header().table_off as usize, r.header().table_len as usize)
    };
    for slot in bytes[to..to + len].chunks_mut(table::SLOT) {
        if slot[4..8] == [0, 0, 0, 0] {
            slot[4..8].copy_from_slice(&1u32.to_le_bytes());
        }
    }
    reseal(&mut bytes);
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(r.lookup(&Key::Str("nope".into())).unwrap(), None);
    assert_eq!(r.lookup(&Key::Str("D00000003".into())).unwrap(), Some(3));
}

/// Archives of another format version are refused with a message that says what to do.
#[test]
fn other_versions_are_refused() {
    let mut bytes = build_dict(3);
    bytes[8..10].copy_from_slice(&1u16.to_le_bytes());
    reseal(&mut bytes);
    let err = Reader::open(&bytes[..]).err().expect("refused");
    assert!(matches!(err, ArchiveError::Version(1)));
    let msg = err.to_string();
    assert!(
        msg.contains("version 1") && msg.contains("rebuild"),
        "{msg}"
    );
}

/// A stored dict of more than `DICT_INDEX_MIN` entries carries an index (table.rs) that the
/// reader probes with the same home-slot rule: every key is found, absent keys are not.
#[test]
fn record_index_lookup() {
    use super::value::{dict_has_index, DICT_INDEX_MIN};
    for n in [DICT_INDEX_MIN + 1, 40, 1000] {
        assert!(dict_has_index(n));
        let keys: Vec<Key<'_>> = (0..n)
            .map(|i| match i % 3 {
                0 => Key::Str(format!("field-{i}").into()),
                1 => Key::Int(i as i64 * 7919),
                _ => Key::Tuple(vec![Key::Int(i as i64), Key::None]),
            })
            .collect();
        let mut items = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            items.push(match k {
                Key::Str(s) => Value::Str(s.to_string()),
                Key::Int(v) => Value::Int(*v),
                _ => Value::Tuple(vec![Value::Int(i as i64), Value::None]),
            });
            items.push(Value::Int(i as i64));
        }
        let hashes: Vec<u64> = keys.iter().map(Key::stable_hash).collect();
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
        b.finish_record(&Value::dict(items, &hashes)).unwrap();
        let bytes = b.finish(0).unwrap().0.into_inner();
        let r = Reader::open(&bytes[..]).unwrap();
        let ArchivedValue::IndexedDict(d) = r.get(r.root(0).unwrap()) else {
            panic!("a dict of {n} entries has an index")
        };
        let (items, index) = (d.items.as_slice(), d.index.as_slice());
        assert_eq!(index.len(), table::record_index_capacity(n));
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(r.dict_find(items, index, k).unwrap(), Some(i), "{k:?}");
            if let Key::Str(s) = k {
                assert_eq!(r.dict_find_str(items, index, s).unwrap(), Some(i));
            }
        }
        assert_eq!(r.dict_find_str(items, index, "absent").unwrap(), None);
        assert_eq!(r.dict_find(items, index, &Key::Int(-1)).unwrap(), None);
        // Python equality: 7919.0 finds the int key 7919.
        assert_eq!(
            r.dict_find(items, index, &Key::Float(7919.0)).unwrap(),
            Some(1)
        );
    }
    // Small dicts have no index and are scanned.
    assert!(!dict_has_index(DICT_INDEX_MIN));
    assert!(matches!(
        Value::dict(vec![Value::Str("a".into()), Value::None], &[]),
        Value::Dict(_)
    ));
}

#[test]
fn lookup_misses_in_a_written_dict_index_are_confirmed_clean() {
    // An index as the writer makes it (`table::record_index`): a miss must not be taken for
    // a forged index.
    let keys: Vec<String> = (0..20).map(|i| format!("field{i}")).collect();
    let hashes: Vec<u64> = keys
        .iter()
        .map(|k| Key::Str(k.as_str().into()).stable_hash())
        .collect();
    let items = keys
        .iter()
        .enumerate()
        .flat_map(|(i, k)| [Value::Str(k.clone()), Value::Int(i as i64)])
        .collect();
    let v = Value::IndexedDict(Box::new(value::IndexedDict {
        items,
        index: table::record_index(&hashes),
    }));
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
    b.finish_record(&v).unwrap();
    let bytes = b.finish(0).unwrap().0.into_inner();
    let r = Reader::open(&bytes[..]).unwrap();
    let ArchivedValue::IndexedDict(d) = r.get(r.root(0).unwrap()) else {
        panic!("not an indexed dict")
    };
    for k in &keys {
        assert!(r.dict_find_str(&d.items, &d.index, k).unwrap().is_some());
    }
    assert_eq!(r.dict_find_str(&d.items, &d.index, "absent").unwrap(), None);
    r.confirm_miss(0).unwrap();
}
