//! Encoder/builder/reader round trips and corruption checks (no Python).

use std::io::Cursor;

use super::format::Elem;
use super::reader::Form;
use super::value::{Extent, DICT_INDEX_MIN};
use super::*;

/// Read a value back as a `Value` (what the Python layer does, in Rust).
pub(crate) fn decode(
    r: &Reader<&[u8]>,
    item: Item<'_>,
    depth: usize,
) -> Result<Value, ArchiveError> {
    if depth > value::MAX_VALUE_DEPTH + 1 {
        return Err(ArchiveError::Corrupt("too deep".into()));
    }
    Ok(match item {
        Item::None => Value::None,
        Item::Bool(b) => Value::Bool(b),
        Item::Int(i) => Value::Int(i),
        Item::BigInt(b) => Value::BigInt(b.to_vec()),
        Item::Float(f) => Value::Float(f),
        Item::Complex(a, b) => Value::Complex([a, b]),
        Item::Str(s) => Value::Str(
            std::str::from_utf8(s)
                .map_err(|_| ArchiveError::Corrupt("utf8".into()))?
                .into(),
        ),
        Item::Sym(id) => Value::Str(r.symbol(id)?.into()),
        Item::Bytes(b) => Value::Bytes(b.to_vec()),
        Item::BytesExt(e) => Value::Bytes(r.payload(e)?.to_vec()),
        Item::Array(a) => {
            let v = r.array(a)?;
            Value::Array(Box::new(ArrayMeta {
                typestr: v.typestr.as_str().into(),
                shape: v.shape.iter().map(|&d| d as u64).collect(),
                data: Extent {
                    offset: v.offset as u64,
                    len: v.nbytes as u64,
                    checksum: 0,
                },
            }))
        }
        Item::List(n) | Item::Tuple(n) => {
            let items = (0..r.seq_len(n)?)
                .map(|i| decode(r, r.seq_item(n, i)?, depth + 1))
                .collect::<Result<Vec<_>, _>>()?;
            if r.is_tuple(n) {
                Value::Tuple(items)
            } else {
                Value::List(items)
            }
        }
        Item::Dict(n) => Value::Dict(
            (0..r.dict_len(n)?)
                .map(|i| {
                    Ok((
                        decode(r, r.dict_key(n, i)?, depth + 1)?,
                        decode(r, r.dict_value(n, i)?, depth + 1)?,
                    ))
                })
                .collect::<Result<Vec<_>, ArchiveError>>()?,
        ),
    })
}

fn s(x: &str) -> Value {
    Value::Str(x.into())
}

fn dict(pairs: Vec<(&str, Value)>) -> Value {
    Value::Dict(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn coco(i: i64) -> Value {
    let anns = (0..(i % 11 + 1))
        .map(|j| {
            dict(vec![
                (
                    "bbox",
                    Value::List(vec![
                        Value::Float(1.5 + j as f64),
                        Value::Float(2.25),
                        Value::Float(100.0),
                        Value::Float(33.75),
                    ]),
                ),
                ("category_id", Value::Int(1 + (i * 7 + j) % 90)),
                ("area", Value::Float(1234.5 * j as f64)),
                ("iscrowd", Value::Int(0)),
                ("id", Value::Int(i * 11 + j + 1)),
            ])
        })
        .collect();
    dict(vec![
        ("file_name", s(&format!("{i:012}.jpg"))),
        ("height", Value::Int(480)),
        ("width", Value::Int(640)),
        ("image_id", Value::Int(i + 1)),
        ("annotations", Value::List(anns)),
    ])
}

fn build(kind: Kind, values: &[Value]) -> Vec<u8> {
    let mut b = Builder::new(Cursor::new(Vec::new()), kind, 1).unwrap();
    for (i, v) in values.iter().enumerate() {
        if kind == Kind::Dict {
            b.add_key(&Key::Int(i as i64)).unwrap();
        }
        b.finish_record(v).unwrap();
    }
    let (out, len) = b.finish(0).unwrap();
    let bytes = out.into_inner();
    assert_eq!(bytes.len() as u64, len);
    bytes
}

fn roundtrip(values: &[Value]) {
    let bytes = build(Kind::List, values);
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(r.len(), values.len() as u64);
    for (i, v) in values.iter().enumerate() {
        let root = r.root(i as u64).unwrap();
        let got = decode(&r, r.item(root).unwrap(), 0).unwrap();
        assert_eq!(&same_bits(got), &same_bits(v.clone()), "record {i}");
    }
    r.validate_all().unwrap();
}

/// Floats compared by their bits (NaN payloads, -0.0).
fn same_bits(v: Value) -> Value {
    match v {
        Value::Float(f) => Value::Int(f.to_bits() as i64),
        Value::List(x) => Value::List(x.into_iter().map(same_bits).collect()),
        Value::Tuple(x) => Value::Tuple(x.into_iter().map(same_bits).collect()),
        Value::Dict(x) => Value::Dict(
            x.into_iter()
                .map(|(k, v)| (same_bits(k), same_bits(v)))
                .collect(),
        ),
        v => v,
    }
}

#[test]
fn every_type_round_trips_exactly() {
    let nan = f64::from_bits(0x7ff8_0000_dead_beef);
    roundtrip(&[
        Value::None,
        Value::Bool(true),
        Value::Int(-1),
        Value::Int(i64::MIN),
        Value::Int(300),
        Value::Int(70_000),
        Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 1]),
        Value::Float(-0.0),
        Value::Float(nan),
        Value::Complex([1.0, -2.0]),
        s(""),
        s("héllo"),
        Value::Bytes(vec![0, 255]),
        Value::List(vec![]),
        Value::Tuple(vec![]),
        Value::Dict(vec![]),
        Value::List(vec![Value::Int(1), Value::Int(100_000)]),
        Value::Tuple(vec![Value::Float(1.0), Value::Float(nan)]),
        Value::List(vec![Value::Bool(true), Value::Bool(false)]),
        Value::List(vec![
            Value::Int(1),
            Value::Float(1.0),
            Value::Bool(true),
            Value::None,
        ]),
        Value::List(vec![Value::Int(1), Value::Bool(true)]),
        dict(vec![
            ("a", Value::Int(1)),
            ("b", Value::None),
            ("c", Value::Bool(false)),
        ]),
        dict(vec![(
            "t",
            Value::Tuple(vec![Value::Int(1), Value::Int(2)]),
        )]),
        dict(vec![("t", Value::List(vec![Value::Int(1), Value::Int(2)]))]),
        // The same key set with values of other types: new shapes or refs, exact types back.
        dict(vec![
            ("a", s("x")),
            ("b", Value::Int(5)),
            ("c", Value::Float(0.5)),
        ]),
        dict(vec![
            ("a", Value::Int(1 << 40)),
            ("b", Value::None),
            ("c", Value::Bool(true)),
        ]),
        Value::Dict(vec![
            (Value::Int(1), s("one")),
            (Value::Tuple(vec![Value::None, s("k")]), s("tuple")),
            (Value::Bool(false), Value::None),
        ]),
        Value::List(vec![
            dict(vec![("x", Value::Int(1))]),
            dict(vec![("x", Value::Int(1000))]),
            dict(vec![("x", s("later a str"))]),
        ]),
        Value::List(vec![
            dict(vec![("x", Value::Int(1))]),
            dict(vec![("y", Value::Int(1))]),
        ]),
        Value::List(vec![Value::List(vec![Value::List(vec![s("deep")])])]),
    ]);
}

#[test]
fn big_dicts_use_the_general_layout_with_an_index() {
    for n in [DICT_INDEX_MIN + 1, 70, 1000] {
        let v = Value::Dict(
            (0..n)
                .map(|i| match i % 3 {
                    0 => (s(&format!("field-{i}")), Value::Int(i as i64)),
                    1 => (Value::Int(i as i64 * 7919), Value::Int(i as i64)),
                    _ => (
                        Value::Tuple(vec![Value::Int(i as i64), Value::None]),
                        Value::Int(i as i64),
                    ),
                })
                .collect(),
        );
        let bytes = build(Kind::Object, std::slice::from_ref(&v));
        let r = Reader::open(&bytes[..]).unwrap();
        let Item::Dict(node) = r.item(r.root(0).unwrap()).unwrap() else {
            panic!("not a dict")
        };
        assert!(r.dict_indexed(node));
        for i in 0..n {
            let k = r.item_key(r.dict_key(node, i).unwrap()).unwrap();
            assert_eq!(r.dict_find(node, &k).unwrap(), Some(i));
        }
        assert_eq!(r.dict_find_str(node, "absent").unwrap(), None);
        assert_eq!(r.dict_find(node, &Key::Float(7919.0)).unwrap(), Some(1));
        r.confirm_miss(0).unwrap();
        roundtrip(&[v]);
    }
}

#[test]
fn coco_records_use_shapes_and_packed_fields() {
    let values: Vec<Value> = (0..300).map(coco).collect();
    roundtrip(&values);
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    // Two key sets; ints widen a few times: a handful of shapes, not one per record.
    assert!(r.shapes().len() <= 8, "{} shapes", r.shapes().len());
    let Item::Dict(root) = r.item(r.root(5).unwrap()).unwrap() else {
        panic!()
    };
    assert!(r.dict_shape_keys(root).is_some());
    let anns = r.dict_find_str(root, "annotations").unwrap().unwrap();
    let Item::List(anns) = r.dict_value(root, anns).unwrap() else {
        panic!()
    };
    let Item::Dict(a0) = r.seq_item(anns, 0).unwrap() else {
        panic!()
    };
    let Item::List(bbox) = r.dict_value(a0, 0).unwrap() else {
        panic!()
    };
    assert!(matches!(
        bbox.form(),
        Form::Pack {
            elem: Elem::F64,
            count: 4,
            tuple: false
        }
    ));
    assert_eq!(r.seq_item(bbox, 2).unwrap(), Item::Float(100.0));
    // Bytes per record, all metadata included.
    let per = bytes.len() / values.len();
    assert!(per < 400, "{per} bytes per record");
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
    assert_eq!(r.item(r.root(500).unwrap()).unwrap(), Item::Int(1000));
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
    let values: Vec<Value> = (0..10).map(coco).collect();
    let bytes = build(Kind::List, &values);
    for cut in [0, 1, 64, 127, 128, 200, bytes.len() - 1] {
        assert!(Reader::open(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn unsealed_is_refused() {
    let mut bytes = vec![0u8; 256];
    bytes[..8].copy_from_slice(&header::UNSEALED_MAGIC);
    assert!(matches!(
        Reader::open(&bytes[..]),
        Err(ArchiveError::Unsealed)
    ));
}

/// Every single-byte corruption of records or metadata is detected by open() or by the
/// first access of the record it hits; none panics.
#[test]
fn every_byte_flip_is_detected() {
    let values: Vec<Value> = (0..3).map(coco).collect();
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    let idx = r.header().index_off;
    let covered = |i: usize| {
        i < header::HEADER_LEN
            || i as u64 >= idx
            || (0..3).any(|rec| {
                let (s, l) = header::record_span(&bytes, idx, rec).unwrap();
                (s..s + l).contains(&(i as u64))
            })
    };
    for i in (0..bytes.len()).filter(|&i| covered(i)) {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        let detected = match Reader::open(&b[..]) {
            Err(_) => true,
            Ok(r) => (0..r.len()).any(|rec| r.root(rec).is_err()),
        };
        // (Padding before the metadata is in no record and not read.)
        assert!(detected, "flip at byte {i} went unnoticed");
    }
}

#[test]
fn payloads_are_out_of_line_aligned_and_verified_on_demand() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
    let data: Vec<u8> = (0..80u8).collect();
    let ext = b.write_payload(&data).unwrap();
    let v = Value::Array(Box::new(ArrayMeta {
        typestr: "<f8".into(),
        shape: vec![2, 5],
        data: ext,
    }));
    b.finish_record(&v).unwrap();
    let mut bytes = b.finish(0).unwrap().0.into_inner();
    {
        let r = Reader::open(&bytes[..]).unwrap();
        let Item::Array(a) = r.item(r.root(0).unwrap()).unwrap() else {
            panic!()
        };
        let a = r.array(a).unwrap();
        assert_eq!(a.shape, vec![2, 5]);
        assert_eq!(a.offset % 64, 0);
        assert_eq!(&bytes[a.offset..a.offset + a.nbytes], &data[..]);
        r.validate_all().unwrap();
    }
    // A modified payload: still readable (any bits are a valid f8 array), found by verify.
    let at = ext.offset as usize + 3;
    bytes[at] ^= 1;
    let r = Reader::open(&bytes[..]).unwrap();
    assert!(r.root(0).is_ok());
    let err = r.validate_all().unwrap_err();
    assert!(err.to_string().contains("was modified"), "{err}");
}

/// Recompute the checksums after editing bytes (what a forger would do).
fn reseal(bytes: &mut [u8]) {
    header::reseal(bytes);
}

/// A crafted record whose references share a child (a DAG) or point back is refused when
/// its block is checked: reads never need a work budget.
#[test]
fn shared_or_backward_references_are_corrupt() {
    let v = Value::List(vec![s("a"), s("b")]);
    let mut bytes = build(Kind::Object, std::slice::from_ref(&v));
    let r = Reader::open(&bytes[..]).unwrap();
    let (start, _) = header::record_span(&bytes, r.header().index_off, 0).unwrap();
    drop(r);
    // LIST tag, count 2, then two refs: point the second at the first's target.
    let refs = start as usize + 2;
    let first = u32::from_le_bytes(bytes[refs..refs + 4].try_into().unwrap());
    bytes[refs + 4..refs + 8].copy_from_slice(&(first - 4).to_le_bytes());
    reseal(&mut bytes);
    let r = Reader::open(&bytes[..]).unwrap();
    assert!(matches!(r.root(0), Err(ArchiveError::Corrupt(_))));
}

#[test]
fn other_versions_are_refused() {
    let mut bytes = build(Kind::List, &[Value::None]);
    bytes[8..10].copy_from_slice(&3u16.to_le_bytes());
    reseal(&mut bytes);
    let err = Reader::open(&bytes[..]).err().expect("refused");
    assert!(matches!(err, ArchiveError::Version(3)));
    let msg = err.to_string();
    assert!(
        msg.contains("version 3") && msg.contains("rebuild"),
        "{msg}"
    );
}

#[test]
fn blocks_cover_records_in_groups() {
    let values: Vec<Value> = (0..1000).map(Value::Int).collect();
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(
        r.header().blocks(),
        1000u64.div_ceil(builder::BLOCK_RECORDS)
    );
    // Touching one record checks its block: its neighbours are then free.
    r.root(130).unwrap();
    assert_eq!(r.item(r.root(129).unwrap()).unwrap(), Item::Int(129));
}

/// Checking a block marks exactly its own records as checked, also when the block straddles
/// two words of the bitmap: a record of another block must never be taken as checked.
#[test]
fn checking_a_block_marks_exactly_its_records() {
    // Records of ~100 bytes: blocks close at BLOCK_BYTES before BLOCK_RECORDS, so their
    // bounds fall at places other than multiples of 64.
    let values: Vec<Value> = (0..700).map(|i| s(&format!("{i:098}"))).collect();
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    let firsts = r.block_first.clone();
    assert!(
        firsts.iter().any(|&f| f % 64 != 0),
        "no block starts inside a word"
    );
    let mut checked = vec![false; 700];
    for (b, &first) in firsts.iter().enumerate().step_by(3) {
        let last = firsts.get(b + 1).copied().unwrap_or(700);
        r.validate_record(last - 1).unwrap();
        for c in &mut checked[first as usize..last as usize] {
            *c = true;
        }
        for (rec, &want) in checked.iter().enumerate() {
            assert_eq!(
                r.is_validated(rec as u64),
                want,
                "record {rec} after block {b}"
            );
        }
    }
}

#[test]
fn long_records_keep_their_length_outside_the_index() {
    let big = s(&"x".repeat(100_000));
    roundtrip(&[
        Value::Int(1),
        big.clone(),
        Value::Int(2),
        Value::List(vec![big]),
    ]);
}

/// The table's record hint is only prefetched: garbage in it changes no answer.
#[test]
fn table_record_hints_are_only_prefetched() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Dict, 1).unwrap();
    for i in 0..500i64 {
        b.add_key(&Key::Str(format!("D{i:08}").into())).unwrap();
        b.finish_record(&Value::Int(i)).unwrap();
    }
    let mut bytes = b.finish(0).unwrap().0.into_inner();
    let (to, end) = {
        let r = Reader::open(&bytes[..]).unwrap();
        (r.header().table_off as usize, r.header().total_len as usize)
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for (n, slot) in bytes[to..end].chunks_mut(table::SLOT).enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = if n % 2 == 0 { u32::MAX } else { u32::MAX - 7 };
        slot[8..12].copy_from_slice(&key.to_le_bytes());
        slot[12..16].copy_from_slice(&(x as u32).to_le_bytes());
    }
    reseal(&mut bytes);
    let r = Reader::open(&bytes[..]).unwrap();
    for i in 0..500u64 {
        assert_eq!(
            r.lookup(&Key::Str(format!("D{i:08}").into())).unwrap(),
            Some(i)
        );
    }
    assert_eq!(r.lookup(&Key::Str("D99999999".into())).unwrap(), None);
}

/// Blocks of very different sizes (a few large records, runs of tiny ones): the block of
/// every record is found, the one whose range holds it.
#[test]
fn the_block_of_every_record_is_found() {
    let values: Vec<Value> = (0..3000)
        .map(|i| {
            if i % 97 < 3 {
                s(&"x".repeat(5000))
            } else {
                Value::Int(i)
            }
        })
        .collect();
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    let f = &r.block_first;
    assert!(f.len() > 50, "{} blocks", f.len());
    for rec in 0..values.len() as u64 {
        let b = r.block_of(rec);
        assert!(
            f[b] <= rec && f.get(b + 1).is_none_or(|&n| rec < n),
            "record {rec}"
        );
    }
    roundtrip(&values);
}

/// A dict key given as an interned symbol (`Value::Sym`, what the Python writer passes) is
/// written exactly as the same key given as a str: same bytes, in shaped, struct and
/// general dicts (with and without a hash index), and as a value it reads back as a str.
#[test]
fn interned_keys_write_the_same_bytes_as_str_keys() {
    fn with_syms(b: &mut Builder<Cursor<Vec<u8>>>, v: &Value) -> Value {
        match v {
            Value::Dict(pairs) => Value::Dict(
                pairs
                    .iter()
                    .map(|(k, v)| {
                        let k = match k {
                            Value::Str(s) => Value::Sym(b.intern(s).unwrap()),
                            k => k.clone(),
                        };
                        (k, with_syms(b, v))
                    })
                    .collect(),
            ),
            Value::List(items) => Value::List(items.iter().map(|v| with_syms(b, v)).collect()),
            Value::Tuple(items) => Value::Tuple(items.iter().map(|v| with_syms(b, v)).collect()),
            v => v.clone(),
        }
    }
    let many: Vec<(String, Value)> = (0..80).map(|i| (format!("k{i}"), Value::Int(i))).collect();
    let values = vec![
        coco(1),
        coco(7),
        Value::Dict(many.iter().map(|(k, v)| (s(k), v.clone())).collect()),
        Value::Dict(vec![(s("a"), Value::Int(1)), (Value::Int(2), s("b"))]),
        Value::List(vec![
            dict(vec![("x", s("y"))]),
            dict(vec![("x", Value::Int(3))]),
        ]),
    ];
    let plain = build(Kind::List, &values);
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
    for v in &values {
        let v = with_syms(&mut b, v);
        b.finish_record(&v).unwrap();
    }
    let (out, _) = b.finish(0).unwrap();
    assert_eq!(out.into_inner(), plain);

    // As a value (not a key), a symbol is written as its str.
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
    let id = b.intern("name").unwrap();
    b.finish_record(&Value::List(vec![Value::Sym(id), Value::Int(1)]))
        .unwrap();
    assert!(
        b.finish_record(&Value::Sym(id + 1)).is_err(),
        "an id never given out"
    );
    let (out, _) = b.finish(0).unwrap();
    let bytes = out.into_inner();
    let r = Reader::open(&bytes[..]).unwrap();
    let got = decode(&r, r.item(r.root(0).unwrap()).unwrap(), 0).unwrap();
    assert_eq!(got, Value::List(vec![s("name"), Value::Int(1)]));
}

/// A record of `builder::ALONE_BYTES` or more is a block of its own (its first read hashes
/// it alone); smaller records share blocks.
#[test]
fn large_records_are_blocks_of_their_own() {
    let big = "y".repeat(builder::ALONE_BYTES as usize);
    let values = vec![
        s("a"),
        s("b"),
        s(&big),
        s("c"),
        s("d"),
        s(&big),
        s(&big),
        s("e"),
    ];
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    assert_eq!(r.block_first, vec![0, 2, 3, 5, 6, 7]);
    r.validate_record(2).unwrap();
    assert!(r.is_validated(2) && !r.is_validated(1) && !r.is_validated(3));
    for i in 0..values.len() as u64 {
        r.validate_record(i).unwrap();
    }
}

/// A store whose every record is a block of its own (documents of 512 bytes or more) keeps
/// no table of first records; each record is still checked, alone, on first access, and a
/// corrupted one is found.
#[test]
fn a_store_of_documents_checks_each_alone() {
    let values: Vec<Value> = (0..200).map(|i| s(&format!("{i:0600}"))).collect();
    let bytes = build(Kind::List, &values);
    let r = Reader::open(&bytes[..]).unwrap();
    assert!(r.block_first.is_empty());
    assert_eq!(r.header().blocks(), 200);
    r.validate_record(77).unwrap();
    assert!(r.is_validated(77) && !r.is_validated(76) && !r.is_validated(78));
    for rec in 0..200 {
        assert_eq!(r.block_of(rec), rec as usize);
    }
    roundtrip(&values);
    // A flipped byte in record 150: that record's check fails, its neighbours' do not.
    let mut bad = bytes.clone();
    let (s150, _) = header::record_span(&bad, u64_at(&bad, 32), 150).unwrap();
    bad[s150 as usize + 100] ^= 1;
    let r = Reader::open(&bad[..]).unwrap();
    assert!(r.validate_record(149).is_ok() && r.validate_record(151).is_ok());
    assert!(matches!(
        r.validate_record(150),
        Err(ArchiveError::Corrupt(_))
    ));
}

/// A list of dicts whose rows would take no bytes (every field always None) is written as a
/// list of references, not as struct rows (a reader refuses more rows of no bytes than its
/// record has bytes left, `zero-size-rows` in fuzz.rs), and reads back as written.
#[test]
fn rows_of_no_bytes_are_written_as_references() {
    let row = || dict(vec![("a", Value::None), ("b", Value::None)]);
    let v = Value::List((0..1000).map(|_| row()).collect());
    let bytes = build(Kind::Object, std::slice::from_ref(&v));
    let (st, _) = header::record_span(&bytes, u64_at(&bytes, 32), 0).unwrap();
    assert_eq!(
        bytes[st as usize],
        format::T_LIST,
        "written as a list of references"
    );
    roundtrip(&[v]);
}

/// Payloads of every path (one call, pieces, a second thread for the largest): the bytes
/// land in order after the aligned start and the checksum is xxh3's of exactly them.
#[test]
fn payloads_of_every_size_are_written_whole_with_xxh3_s_checksum() {
    for len in [100usize, (1 << 20) + 1, 3 << 20, (16 << 20) + 12_345] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
        let ext = b.write_payload(&data).unwrap();
        assert_eq!(ext.offset % 64, 0, "length {len}");
        assert_eq!(ext.len, len as u64);
        assert_eq!(
            ext.checksum,
            xxhash_rust::xxh3::xxh3_64(&data),
            "length {len}"
        );
        let v = Value::BytesExt(ext);
        b.finish_record(&v).unwrap();
        let out = b.finish(0).unwrap().0.into_inner();
        let at = ext.offset as usize;
        assert!(out[at..at + len] == data[..], "length {len}");
        Reader::open(&out[..]).unwrap().validate_all().unwrap();
    }
}

/// A sink that fails after `room` bytes.
struct FailingSink {
    room: u64,
    pos: u64,
}

impl std::io::Write for FailingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.pos + buf.len() as u64 > self.room {
            return Err(std::io::Error::other("no room"));
        }
        self.pos += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl std::io::Seek for FailingSink {
    fn seek(&mut self, _: std::io::SeekFrom) -> std::io::Result<u64> {
        Ok(self.pos)
    }
}

impl super::builder::Sink for FailingSink {}

/// A write that fails part-way through a large payload is an error for the caller, on
/// every path (the thread that hashes beside the write is joined, not left running).
#[test]
fn a_failing_write_of_a_large_payload_is_an_error() {
    for len in [3usize << 20, 20 << 20] {
        let data = vec![1u8; len];
        let sink = FailingSink {
            room: (len / 2) as u64,
            pos: 0,
        };
        let mut b = Builder::new(sink, Kind::Object, 1).unwrap();
        let err = b.write_payload(&data).unwrap_err();
        assert!(err.to_string().contains("no room"), "length {len}: {err}");
    }
}

/// The reader refuses exactly what lies beyond the writer's limits (docs/format.md,
/// "Depth"): containers 100 deep read (and `verify` passes them), 101 deep are corrupt,
/// whatever the deepest one is (a list, packed numbers, a shaped dict or its packed field,
/// the rows of a list of dicts); a key of 32 tuples in the deepest dict reads, one of 33 is
/// corrupt. Before, anything up to 133 levels read, and `put(view)` of it was refused.
#[test]
fn the_depth_limits_are_the_writers() {
    let nest = |n: usize, inner: Value| (0..n).fold(inner, |v, _| Value::List(vec![v]));
    let ints = || Value::List(vec![Value::Int(1), Value::Int(2)]);
    let row = |v: Value| dict(vec![("a", v)]);
    // The innermost value, and how many containers deep it is.
    let cases: Vec<(Value, usize)> = vec![
        (Value::List(vec![]), 1),
        (Value::List(vec![s("x"), Value::None]), 1),
        (ints(), 1),
        (Value::Tuple(vec![Value::Tuple(vec![])]), 2),
        (row(Value::Int(1)), 1),
        (row(ints()), 2),
        (Value::List(vec![row(Value::Int(1)), row(Value::Int(2))]), 2),
        (Value::List(vec![row(ints()), row(ints())]), 3),
    ];
    let check = |v: Value, ok: bool, limit: &str| {
        let bytes = build(Kind::List, &[v]);
        let r = Reader::open(&bytes[..]).unwrap();
        if ok {
            r.root(0).unwrap();
            r.validate_all().unwrap();
        } else {
            let err = r.root(0).unwrap_err();
            assert!(
                matches!(err, ArchiveError::Corrupt(_))
                    && err
                        .to_string()
                        .contains(&format!("deeper than {limit} levels")),
                "{err}"
            );
            assert!(matches!(r.validate_all(), Err(ArchiveError::Corrupt(_))));
        }
    };
    for (inner, deep) in cases {
        check(nest(value::MAX_DEPTH - deep, inner.clone()), true, "");
        check(nest(value::MAX_DEPTH - deep + 1, inner), false, "100");
    }
    check(fuzz::deep_key(value::MAX_KEY_DEPTH), true, "");
    check(fuzz::deep_key(value::MAX_KEY_DEPTH + 1), false, "32");
}

/// A shape naming one key twice (the same symbol, or two symbols of one string) is refused
/// when the archive opens: a writer never makes one, and its dicts had two entries
/// (`len(v) == 2`) but one key as a Python dict (`to_python() == {'a': 2}`).
#[test]
fn a_shape_with_a_key_twice_is_refused_at_open() {
    for name in ["shape-key-twice", "shape-key-twice-by-name"] {
        let (_, bytes) = fuzz::crafted(name).unwrap();
        match Reader::open(&bytes[..]) {
            Err(ArchiveError::Corrupt(m)) => {
                assert!(m.contains("has the key \"a\" twice"), "{name}: {m}")
            }
            Err(e) => panic!("{name}: {e:?}"),
            Ok(_) => panic!("{name}: opened"),
        }
    }
}

/// A view of a dict whose every value is None, written last in its record, takes no bytes
/// and sits at the record's very end: rebuilding it from a pickle (`node_from`) refused it
/// as a position outside the record. Found by the fuzz test's check that `verify()` passes
/// only what reads take.
#[test]
fn a_node_of_no_bytes_at_the_end_of_its_record_is_rebuilt() {
    let v = Value::List(vec![s("x"), dict(vec![("a", Value::None)])]);
    let bytes = build(Kind::List, &[v]);
    let r = Reader::open(&bytes[..]).unwrap();
    let (start, len) = header::record_span(&bytes, r.header().index_off, 0).unwrap();
    let end = start + len;
    let Item::List(list) = r.item(r.root(0).unwrap()).unwrap() else {
        panic!("not a list")
    };
    let Item::Dict(d) = r.seq_item(list, 1).unwrap() else {
        panic!("not a dict")
    };
    assert_eq!(
        d.pos(),
        end,
        "the dict's slots take no bytes, at the record's end"
    );
    let again = r.node_from(0, d.pos(), d.form_code()).unwrap();
    assert_eq!(again, d);
    assert_eq!(r.dict_len(again).unwrap(), 1);
    assert_eq!(r.dict_value(again, 0).unwrap(), Item::None);
    // Past the end, or a node that takes bytes there, is still refused.
    assert!(r.node_from(0, d.pos() + 1, d.form_code()).is_err());
    assert!(r.node_from(0, d.pos(), (0, 0)).is_err());
}

/// Record 0's bytes edited at `at` (from its start), the checksums made right again.
fn edit_record(mut bytes: Vec<u8>, at: usize, with: &[u8]) -> Vec<u8> {
    let index_off = Reader::open(&bytes[..]).unwrap().header().index_off;
    let (start, _) = header::record_span(&bytes, index_off, 0).unwrap();
    let at = start as usize + at;
    bytes[at..at + with.len()].copy_from_slice(with);
    reseal(&mut bytes);
    bytes
}

/// Everything a read (of the Rust reader, as the Python layer uses it) refuses in `bytes`:
/// record values read whole, every key of a dict archive and its lookup.
fn reads_refuse(bytes: &[u8]) -> bool {
    let r = Reader::open(bytes).unwrap();
    let mut refused = false;
    for rec in 0..r.len() {
        let read = r.root(rec).and_then(|n| decode(&r, r.item(n)?, 0));
        // `decode` takes any value as a key; reads check keys (`item_key`) too.
        let keys = r.root(rec).and_then(|n| match r.item(n)? {
            Item::Dict(d) => (0..r.dict_len(d)?).try_for_each(|i| {
                r.item_key(r.dict_key(d, i)?)?;
                Ok::<(), ArchiveError>(())
            }),
            _ => Ok(()),
        });
        refused |= read.is_err() || keys.is_err();
        if r.kind() == Kind::Dict {
            refused |= r.key(rec).and_then(|k| r.lookup(&k)).is_err();
        }
    }
    refused
}

/// `verify()` (`validate_all`) refuses what reads refuse: it reads every value through the
/// functions reads use, and a dict archive's keys and table as lookups do. Each archive
/// here passed `verify()` before, yet a read of it raised `CorruptStoreError`.
#[test]
fn verify_refuses_what_reads_refuse() {
    let flag = |v: Value| dict(vec![("flag", v)]);
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        // Packed bools: tag, element type, count 2, then the elements; one is 2.
        ("a packed bool of 2", {
            let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
            b.finish_raw_record(&[format::T_LIST_PACKED, Elem::Bool as u8, 2, 1, 2])
                .unwrap();
            b.finish(0).unwrap().0.into_inner()
        }),
        // A shaped dict {"flag": True}: tag, shape id, the bool's slot, made 2.
        (
            "a bool slot of 2",
            edit_record(build(Kind::Object, &[flag(Value::Bool(true))]), 2, &[2]),
        ),
        ("a list as a dict key", {
            let v = Value::Dict(vec![(Value::List(vec![]), Value::None)]);
            build(Kind::Object, &[v])
        }),
        ("a str that is not UTF-8", {
            let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
            b.finish_raw_record(&[format::T_STR, 2, 0xc3, 0x28])
                .unwrap();
            b.finish(0).unwrap().0.into_inner()
        }),
    ];
    // A dict archive of three records (keys 0, 1, 2): its key offsets, then its table.
    let keyed = || build(Kind::Dict, &[Value::None, Value::Int(1), s("two")]);
    let h = |b: &[u8]| header::Header::parse(b).unwrap();
    cases.push(("backwards key offsets", {
        let mut b = keyed();
        // Key 1 starts after where it ends (its start is key 0's end).
        let ko = h(&b).keys_off as usize;
        let end = u64_at(&b, ko + 16);
        b[ko + 8..ko + 16].copy_from_slice(&(end + 1).to_le_bytes());
        reseal(&mut b);
        b
    }));
    cases.push(("a table entry out of range", {
        let mut b = keyed();
        let (to, len) = (h(&b).table_off as usize, h(&b).table_len() as usize);
        // The slot of entry 1 names entry 99.
        let slot = (0..len / table::SLOT)
            .map(|i| to + i * table::SLOT)
            .find(|&at| u32_at(&b, at + 4) == 2)
            .unwrap();
        b[slot + 4..slot + 8].copy_from_slice(&100u32.to_le_bytes());
        reseal(&mut b);
        b
    }));
    for (what, bytes) in cases {
        assert!(reads_refuse(&bytes), "{what}: reads take it");
        let r = Reader::open(&bytes[..]).unwrap();
        match r.validate_all() {
            Err(ArchiveError::Corrupt(_)) => {}
            other => panic!("{what}: verify gave {other:?}"),
        }
    }
}

/// A dict with a hash index and a NaN key (which equals nothing, as in Python) is sound:
/// confirming a miss, and `verify()`, took the NaN that its own hash does not find for a
/// forged index.
#[test]
fn an_indexed_dict_with_a_nan_key_confirms_a_miss() {
    let mut pairs: Vec<(Value, Value)> = (0..DICT_INDEX_MIN as i64 + 1)
        .map(|i| (Value::Int(i), Value::Int(i)))
        .collect();
    pairs.push((Value::Float(f64::NAN), Value::None));
    pairs.push((
        Value::Tuple(vec![Value::Int(1), Value::Float(f64::NAN)]),
        Value::None,
    ));
    let bytes = build(Kind::List, &[Value::Dict(pairs)]);
    let r = Reader::open(&bytes[..]).unwrap();
    let Item::Dict(d) = r.item(r.root(0).unwrap()).unwrap() else {
        panic!("not a dict")
    };
    assert!(r.dict_indexed(d));
    assert_eq!(r.dict_find(d, &Key::Int(1000)).unwrap(), None);
    r.confirm_miss(0).unwrap();
    r.validate_all().unwrap();
}

/// Prefetching is a hint: any range, however far past the bytes or reversed, is cut to
/// them and never panics (it runs inside the read slots, where a panic would be an error).
#[test]
fn prefetch_lines_accepts_any_range() {
    use super::reader::prefetch_lines;
    let bytes = vec![7u8; 1000];
    for (start, end) in [
        (0, 0),
        (0, 1000),
        (10, 5),
        (999, 100_000),
        (1000, 2000),
        (5000, 6000),
        (usize::MAX - 1, usize::MAX),
        (0, usize::MAX),
    ] {
        prefetch_lines(&bytes, start, end);
        prefetch_lines(&bytes[..0], start, end);
    }
    assert_eq!(bytes, vec![7u8; 1000]);
}

/// The block check's shortcut for records that hold no nested references (a shaped dict of
/// numbers, strings, packed fields, out-of-line payloads and lists of flat rows) takes every
/// such record a writer makes, and no other; and of every edit of their bytes (each byte
/// changed, each 4-byte word replaced by an edge value, the checksums made right again), it
/// accepts none that the whole walk refuses.
#[test]
fn the_flat_shortcut_accepts_only_what_the_walk_accepts() {
    let mut b = Builder::new(Cursor::new(Vec::new()), Kind::List, 1).unwrap();
    let mut values: Vec<Value> = (0..8).map(coco).collect();
    let data: Vec<u8> = (0..200u8).collect();
    let ext = b.write_payload(&data).unwrap();
    let ext2 = b.write_payload(&data[..64]).unwrap();
    values.push(dict(vec![
        ("id", Value::Int(7)),
        (
            "emb",
            Value::Array(Box::new(ArrayMeta {
                typestr: "<f8".into(),
                shape: vec![25],
                data: ext,
            })),
        ),
        ("raw", Value::BytesExt(ext2)),
    ]));
    // Flat too: a list of strs, dicts inside the dict (one with a list of rows and a
    // payload), all of it in one record.
    values.push(dict(vec![("tags", Value::List(vec![s("a"), s("b")]))]));
    values.push(dict(vec![("meta", dict(vec![("a", Value::Int(1))]))]));
    let ext3 = b.write_payload(&data[..32]).unwrap();
    let ann = |j: i64| {
        dict(vec![
            (
                "bbox",
                Value::List(vec![Value::Float(1.0), Value::Float(j as f64)]),
            ),
            ("category_id", Value::Int(j)),
        ])
    };
    values.push(dict(vec![
        ("id", s("r1")),
        ("tags", Value::List(vec![s("a"), Value::Int(3), s("b")])),
        (
            "meta",
            dict(vec![
                ("w", Value::Int(640)),
                ("src", s("cam")),
                ("boxes", Value::List(vec![ann(1), ann(2)])),
            ]),
        ),
        (
            "geo",
            dict(vec![
                ("lat", Value::Float(1.5)),
                ("raw", Value::BytesExt(ext3)),
            ]),
        ),
        ("empty", Value::List(vec![])),
    ]));
    // Not flat: a dict two levels down, a list of lists, a list root.
    values.push(dict(vec![(
        "a",
        dict(vec![("b", dict(vec![("c", Value::Int(1))]))]),
    )]));
    values.push(dict(vec![(
        "l",
        Value::List(vec![Value::List(vec![s("x")])]),
    )]));
    values.push(Value::List(vec![Value::Int(1), s("x")]));
    for v in &values {
        b.finish_record(v).unwrap();
    }
    let bytes = b.finish(0).unwrap().0.into_inner();
    let r = Reader::open(&bytes[..]).unwrap();
    let n = r.len();
    let flat: Vec<u64> = (0..n)
        .filter(|&rec| r.flat_and_walk(rec).is_some())
        .collect();
    assert_eq!(flat, (0..12).collect::<Vec<_>>());
    assert!((0..n).all(|rec| r.flat_and_walk(rec) != Some(false)));
    let idx = r.header().index_off as usize;
    drop(r);
    let mut accepted_edits = 0;
    let mut check = |edited: &mut Vec<u8>| {
        reseal(edited);
        if let Ok(r) = Reader::open(&edited[..]) {
            for rec in 0..r.len() {
                match r.flat_and_walk(rec) {
                    Some(false) => {
                        panic!("record {rec}: the shortcut accepts what the walk refuses")
                    }
                    Some(true) => accepted_edits += 1,
                    None => {}
                }
            }
        }
    };
    for at in header::HEADER_LEN..idx {
        for v in [
            0x00u8,
            0xff,
            0x80,
            bytes[at] ^ 0x5a,
            bytes[at].wrapping_add(1),
        ] {
            let mut edited = bytes.clone();
            edited[at] = v;
            check(&mut edited);
        }
        if at + 4 <= idx {
            for w in [0u32, 1, 2, 4, 0x7f, 0x8000_0000, u32::MAX] {
                let mut edited = bytes.clone();
                edited[at..at + 4].copy_from_slice(&w.to_le_bytes());
                check(&mut edited);
            }
        }
    }
    // Edits of numbers' bytes leave records the shortcut takes (and the walk too).
    assert!(accepted_edits > 0);
    // The array and the bytes made to name one payload: both refuse it.
    let (o1, o2) = (ext.offset.to_le_bytes(), ext2.offset.to_le_bytes());
    let at = (header::HEADER_LEN..idx - 8)
        .find(|&i| bytes[i..i + 8] == o2)
        .expect("the bytes' extent is in its record");
    let mut edited = bytes.clone();
    edited[at..at + 8].copy_from_slice(&o1);
    reseal(&mut edited);
    let r = Reader::open(&edited[..]).unwrap();
    assert_eq!(r.flat_and_walk(8), None);
    let err = r.root(8).unwrap_err().to_string();
    assert!(err.contains("share out-of-line bytes"), "{err}");
}

/// The copy of a stored str into a new ASCII str: every length of every path (the short
/// ones, the 16-byte loop, the overlapping last load), every position of a byte over 127,
/// and what it writes is the bytes, exactly, with nothing written past them.
#[test]
fn copy_ascii_copies_exactly_and_finds_every_non_ascii_byte() {
    let src: Vec<u8> = (0..300u32).map(|i| b' ' + (i * 7 % 95) as u8).collect();
    for n in 0..src.len() {
        let mut dst = vec![0xeeu8; n + 16];
        // SAFETY: `dst` holds `n` bytes and more; it does not overlap `src`.
        let ascii = unsafe { ascii::copy_ascii(&src[..n], dst.as_mut_ptr()) };
        assert!(ascii, "{n} ASCII bytes");
        assert_eq!(&dst[..n], &src[..n], "{n} bytes");
        assert!(
            dst[n..].iter().all(|&b| b == 0xee),
            "written past {n} bytes"
        );
        for at in 0..n {
            for high in [0x80u8, 0xc3, 0xff] {
                let mut s = src[..n].to_vec();
                s[at] = high;
                // SAFETY: as above.
                let ascii = unsafe { ascii::copy_ascii(&s, dst.as_mut_ptr()) };
                assert!(!ascii, "byte {at} of {n} is {high:#x}");
            }
        }
    }
    // Both loops of the long copies, whichever the CPU would pick.
    #[cfg(target_arch = "x86_64")]
    for n in 32..src.len() {
        let loops: &[bool] = if std::is_x86_feature_detected!("avx2") {
            &[false, true]
        } else {
            &[false]
        };
        for &avx2 in loops {
            let copy = |from: &[u8], to: &mut [u8]| -> bool {
                assert!(from.len() >= 32 && to.len() >= from.len());
                let (s, d, n) = (from.as_ptr(), to.as_mut_ptr(), from.len());
                // SAFETY: `to` holds `n >= 32` bytes and does not overlap `from`; the AVX2
                // loop only where the CPU has it.
                unsafe {
                    if avx2 {
                        ascii::copy_ascii_avx2(s, d, n)
                    } else {
                        ascii::copy_ascii_sse2(s, d, n)
                    }
                }
            };
            let mut dst = vec![0xeeu8; n + 32];
            assert!(copy(&src[..n], &mut dst), "avx2 {avx2}: {n}");
            assert_eq!(&dst[..n], &src[..n], "avx2 {avx2}: {n}");
            assert!(dst[n..].iter().all(|&b| b == 0xee), "avx2 {avx2}: past {n}");
            for at in 0..n {
                let mut s = src[..n].to_vec();
                s[at] = 0x80;
                assert!(!copy(&s, &mut dst), "avx2 {avx2}: {at} of {n}");
            }
        }
    }
}
