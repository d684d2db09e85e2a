//! Structure-aware fuzzing of the reader: archives whose checksums are right but whose
//! structure is arbitrary (docs/security.md, "Fuzzing").
//!
//! [`case`] makes one archive from a seed, deterministically:
//! 1. records built through the real [`Builder`] from generated `Value` trees: shaped and
//!    general dicts, packed and struct lists, any key types, arrays with any typestr, shape
//!    and extent, out-of-line bytes anywhere;
//! 2. raw records crafted byte by byte: chains of containers nested from just under to far
//!    over the format's depth limit (tens of thousands of levels);
//! 3. then, for some cases, edits of the bytes: record bytes (tags, forward references,
//!    varint counts, shape ids), index entries, block table, symbols, shapes, keys, dict
//!    table, header;
//! 4. and [`header::reseal`] recomputes every checksum, so only the structural checks stand
//!    between the bytes and the readers.
//!
//! [`read_everything`] then goes through every read path of the Rust reader; the Python
//! tests (tests/test_fuzz.py) take the same cases through `_native._fuzz_case` and every
//! Python read path. The contract under test: a result or `ArchiveError::Corrupt`, never a
//! panic, a crash or a hang.
//!
//! A new format version extends this file where it knows the format: [`raw_chain`] (the
//! byte layout of containers) and the metadata edits in [`mutate`]; the generators of
//! `Value`s follow the value model.
//!
//! (Over 800 lines: the generator, the mutations and the crafted cases share one case model.)

use std::io::Cursor;

use super::format::*;
use super::header::{self, Kind, HEADER_LEN, INDEX_ENTRY};
use super::key::Key;
use super::reader::{Item, Node, Reader};
use super::value::{ArrayMeta, Extent, Value, MAX_DEPTH, MAX_KEY_DEPTH, MAX_VALUE_DEPTH};
use super::{ArchiveError, Builder};

/// A small deterministic generator (splitmix64): cases are reproducible from their seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5348_4d53_544f_5245)
    }

    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.u64() % n
    }

    /// True with probability `p` percent.
    pub fn pct(&mut self, p: u64) -> bool {
        self.below(100) < p
    }

    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// Integers at and around the edges that offsets and lengths are compared against.
const EDGES_U64: &[u64] = &[
    0,
    1,
    7,
    8,
    9,
    63,
    64,
    128,
    4096,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 8,
    u64::MAX - 7,
    u64::MAX,
];

const EDGES_U32: &[u32] = &[
    0,
    1,
    2,
    8,
    9,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fff7, // -9: a relative pointer to the value just before
    0xffff_fff6, // -10
    0xffff_ffff,
];

fn edge_u64(rng: &mut Rng) -> u64 {
    let e = rng.pick(EDGES_U64);
    if rng.pct(30) {
        e.wrapping_add(rng.below(16)).wrapping_sub(8)
    } else {
        e
    }
}

const TYPESTRS: &[&str] = &[
    "<f8",
    "|b1",
    "<i4",
    ">u2",
    "<c16",
    "=f4",
    "<f2",
    "|u1",
    "<f3",
    "|O8",
    "<U4",
    "",
    "<",
    "<f",
    "<f08",
    "<f+8",
    "<é8",
    "é",
    "<f8\u{0}",
    "<f80000000000000000000008",
    ">c8",
];

fn gen_str(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => String::new(),
        1 => "é".repeat(rng.below(5) as usize),
        2 => "\u{10ffff}".into(),
        _ => format!("s{}", rng.below(1000)),
    }
}

fn gen_key(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(8) {
        0 => Value::None,
        1 => Value::Bool(rng.pct(50)),
        2 => Value::Int(rng.u64() as i64),
        3 => Value::Float(f64::from_bits(rng.u64())),
        4 => Value::Bytes(vec![rng.u64() as u8; rng.below(4) as usize]),
        5 => Value::BigInt(vec![0x87; 1 + rng.below(12) as usize]),
        6 if depth < 40 => {
            Value::Tuple((0..rng.below(3)).map(|_| gen_key(rng, depth + 1)).collect())
        }
        _ => Value::Str(gen_str(rng)),
    }
}

/// Field names: few, so that dicts share shapes and shapes get new versions.
const FIELDS: &[&str] = &["id", "é", "name", "bbox", "x"];

/// A payload for an array or out-of-line bytes; its extent is sometimes replaced.
fn gen_extent(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>, len: u64) -> Extent {
    let none = Extent {
        offset: 0,
        len,
        checksum: 0,
    };
    let mut ext = if len <= 4096 && rng.pct(80) {
        b.write_payload(&vec![0x5a; len as usize]).unwrap_or(none)
    } else {
        none
    };
    if rng.pct(15) {
        ext.offset = edge_u64(rng);
    }
    if rng.pct(15) {
        ext.len = edge_u64(rng);
    }
    ext
}

fn gen_array(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>) -> Value {
    let typestr = if rng.pct(70) {
        rng.pick(&TYPESTRS[..8]).to_string()
    } else {
        rng.pick(TYPESTRS).to_string()
    };
    let ndim = match rng.below(10) {
        0 => 65 + rng.below(3) as usize,
        1 => 33,
        _ => rng.below(4) as usize,
    };
    let mut shape: Vec<u64> = (0..ndim).map(|_| rng.below(5)).collect();
    if rng.pct(25) && !shape.is_empty() {
        let i = rng.below(shape.len() as u64) as usize;
        shape[i] = edge_u64(rng);
    }
    let item = super::value::typestr_itemsize(&typestr).unwrap_or(1) as u64;
    let len = shape
        .iter()
        .try_fold(item, |a, &d| a.checked_mul(d))
        .unwrap_or(8);
    let data = gen_extent(rng, b, len.min(1 << 20));
    Value::Array(Box::new(ArrayMeta {
        typestr,
        shape,
        data,
    }))
}

fn gen_scalar(rng: &mut Rng) -> Value {
    match rng.below(6) {
        0 => Value::None,
        1 => Value::Bool(rng.pct(50)),
        2 => Value::Int(edge_u64(rng) as i64),
        3 => Value::Int(rng.below(300) as i64 - 150),
        4 => Value::Float(f64::from_bits(rng.u64())),
        _ => Value::Str(gen_str(rng)),
    }
}

/// A value tree of every layout the encoder has.
fn gen_value(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>, depth: usize) -> Value {
    let leaf = depth >= 6 || rng.pct(35);
    if leaf {
        return match rng.below(11) {
            0..=3 => gen_scalar(rng),
            4 => Value::BigInt(vec![rng.u64() as u8; 9 + rng.below(12) as usize]),
            5 => Value::Complex([1.5, f64::NAN]),
            6 => Value::Bytes(vec![7; rng.below(10) as usize]),
            7 => {
                let len = rng.below(200);
                Value::BytesExt(gen_extent(rng, b, len))
            }
            8 => Value::List(
                (0..rng.below(20))
                    .map(|_| Value::Float(rng.below(9) as f64))
                    .collect(),
            ),
            9 => Value::Tuple(
                (0..1 + rng.below(5))
                    .map(|_| Value::Int(edge_u64(rng) as i64))
                    .collect(),
            ),
            _ => gen_array(rng, b),
        };
    }
    let n = rng.below(5) as usize;
    match rng.below(6) {
        0 => Value::List((0..n).map(|_| gen_value(rng, b, depth + 1)).collect()),
        1 => Value::Tuple((0..n).map(|_| gen_value(rng, b, depth + 1)).collect()),
        2 => {
            // Same-key dicts: a struct list (or a generic one when the keys differ).
            let keys: Vec<&str> = FIELDS[..1 + rng.below(4) as usize].to_vec();
            Value::List(
                (0..1 + n)
                    .map(|_| {
                        Value::Dict(
                            keys.iter()
                                .map(|k| (Value::Str((*k).into()), gen_field(rng, b, depth)))
                                .collect(),
                        )
                    })
                    .collect(),
            )
        }
        3 | 4 => {
            // A shaped dict (str field names), sometimes with a field of another type.
            let keys = &FIELDS[..1 + rng.below(FIELDS.len() as u64) as usize];
            Value::Dict(
                keys.iter()
                    .map(|k| (Value::Str((*k).into()), gen_field(rng, b, depth)))
                    .collect(),
            )
        }
        _ => {
            // The general layout: any keys, sometimes enough for an index.
            let n = if rng.pct(50) {
                9 + rng.below(4) as usize
            } else {
                n
            };
            Value::Dict(
                (0..n)
                    .map(|i| {
                        let k = match gen_key(rng, 0) {
                            Value::Str(s) => Value::Str(format!("{s}{i}")),
                            k => Value::Tuple(vec![Value::Int(i as i64), k]),
                        };
                        (k, gen_value(rng, b, depth + 1))
                    })
                    .collect(),
            )
        }
    }
}

fn gen_field(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>, depth: usize) -> Value {
    match rng.below(4) {
        0 => Value::List(
            (0..4)
                .map(|_| Value::Float(rng.below(100) as f64))
                .collect(),
        ),
        1 => gen_value(rng, b, depth + 2),
        _ => gen_scalar(rng),
    }
}

/// The bytes of a record that is `depth` containers nested in one another around a `None`,
/// laid out as the encoder lays records out (breadth first, forward references). Each
/// level is a list, a tuple or a general dict of one entry whose key is `None` (with
/// `keys`, sometimes the child sits in the key position: a malformed record).
pub fn raw_chain(rng: &mut Rng, depth: usize, keys: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(depth * 11 + 1);
    for _ in 0..depth {
        match rng.below(3) {
            k @ (0 | 1) => {
                // tag, count 1, ref -> the next level right after it
                out.push(if k == 0 { T_LIST } else { T_TUPLE });
                out.push(1);
                out.extend_from_slice(&4u32.to_le_bytes());
            }
            _ => {
                out.push(T_DICT);
                out.push(1);
                if keys && rng.pct(20) {
                    // key -> the next level (after the value None), value -> None
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&4u32.to_le_bytes());
                } else {
                    // key -> None right after, value -> the next level after that
                    out.extend_from_slice(&8u32.to_le_bytes());
                    out.extend_from_slice(&5u32.to_le_bytes());
                }
                out.push(T_NONE);
            }
        }
    }
    out.push(T_NONE);
    out
}

fn gen_top_key(rng: &mut Rng, i: usize) -> Key<'static> {
    match rng.below(5) {
        0 => Key::Int(i as i64),
        1 => Key::Tuple(vec![Key::Int(i as i64), Key::Str("t".into())]),
        2 => Key::Bytes(vec![i as u8, 0xff].into()),
        _ => Key::Str(format!("k{i}").into()),
    }
}

/// Depths around and far beyond the limits.
fn gen_depth(rng: &mut Rng) -> usize {
    match rng.below(6) {
        0 => MAX_DEPTH - 1 + rng.below(4) as usize,
        1 => MAX_VALUE_DEPTH - 1 + rng.below(4) as usize,
        2 => 300 + rng.below(300) as usize,
        3 => 20_000 + rng.below(25_000) as usize,
        _ => 1 + rng.below(40) as usize,
    }
}

fn build(rng: &mut Rng, kind: Kind) -> Vec<u8> {
    let mut b = Builder::new(Cursor::new(Vec::new()), kind, 1).expect("in memory");
    let n = if kind == Kind::Object {
        1
    } else {
        rng.below(6) as usize
    };
    for i in 0..n {
        if kind == Kind::Dict && b.add_key(&gen_top_key(rng, i)).is_err() {
            b.add_key(&Key::Int(-(i as i64) - 1)).expect("unique key");
        }
        if rng.pct(12) {
            let depth = gen_depth(rng);
            let raw = raw_chain(rng, depth, true);
            b.finish_raw_record(&raw).expect("in memory");
        } else {
            let v = gen_value(rng, &mut b, 0);
            b.finish_record(&v).expect("in memory");
        }
    }
    b.finish(0).expect("in memory").0.into_inner()
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Edit the bytes of a sealed archive: records, index, metadata regions, header.
pub fn mutate(rng: &mut Rng, b: &mut [u8]) {
    let len = b.len();
    let index_off = u64_at(b, 32) as usize;
    let count = u64_at(b, 24) as usize;
    let put_u32 = |b: &mut [u8], at: usize, v: u32| {
        if at + 4 <= b.len() {
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    };
    let put_u64 = |b: &mut [u8], at: usize, v: u64| {
        if at + 8 <= b.len() {
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
    };
    for _ in 0..1 + rng.below(3) {
        match rng.below(10) {
            // Record bytes: a tag, a reference, a varint, or any byte.
            0..=4 if index_off > HEADER_LEN && index_off <= len => {
                let at = HEADER_LEN + rng.below((index_off - HEADER_LEN) as u64) as usize;
                match rng.below(5) {
                    0 => b[at] = rng.below(26) as u8,
                    1 => put_u32(b, at, rng.pick(EDGES_U32)),
                    2 => put_u32(b, at, rng.u64() as u32),
                    3 => b[at] = 0x80 | rng.u64() as u8,
                    _ => b[at] ^= 1 << rng.below(8),
                }
            }
            // An index entry: start or length.
            5 if count > 0 => {
                let e = index_off + rng.below(count as u64) as usize * INDEX_ENTRY;
                let v = if rng.pct(50) {
                    edge_u64(rng)
                } else {
                    u64_at(b, e.min(len - 8)) ^ (1 << rng.below(64))
                };
                put_u64(b, e, v);
            }
            // The header fields (counts, regions, kind, version).
            6 => {
                let at = 8 * (1 + rng.below(10) as usize);
                if rng.pct(50) {
                    put_u64(b, at, edge_u64(rng));
                } else {
                    b[at] = b[at].wrapping_add(1 + rng.below(3) as u8);
                }
            }
            // Metadata (blocks, symbols, shapes, keys, table): a u32, a u64 or a byte.
            _ if index_off < len => {
                let at = index_off + rng.below((len - index_off) as u64) as usize;
                match rng.below(3) {
                    0 => put_u32(b, at, rng.pick(EDGES_U32)),
                    1 => put_u64(b, at, edge_u64(rng)),
                    _ => b[at] = rng.u64() as u8,
                }
            }
            _ => {}
        }
    }
}

/// Which kind of archive a case is.
pub fn kind_of(seed: u64) -> Kind {
    match seed % 3 {
        0 => Kind::List,
        1 => Kind::Dict,
        _ => Kind::Object,
    }
}

/// One fuzz case: an archive with valid checksums (see the module docs).
pub fn case(seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let kind = kind_of(seed);
    let mut bytes = build(&mut rng, kind);
    if rng.pct(45) {
        mutate(&mut rng, &mut bytes);
        header::reseal(&mut bytes);
    }
    bytes
}

/// Totals of a fuzz run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Refused when opened.
    pub open_corrupt: u64,
    /// Opened; at least one read raised `Corrupt`.
    pub read_corrupt: u64,
    /// Read back completely.
    pub intact: u64,
    /// Records whose block check took the walk's shortcut (`Reader::flat_record`), each
    /// also walked whole to see that the walk accepts it too.
    pub flat: u64,
}

/// Records the shortcut accepted, over every `read_everything` of this process.
static FLAT_RECORDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Every read path of the Rust reader over one archive. `Ok(true)`: everything read;
/// `Ok(false)`: some read reported `Corrupt`; other errors are returned (a test failure).
pub fn read_everything(bytes: &[u8]) -> Result<bool, ArchiveError> {
    let r = Reader::open(bytes)?;
    let mut clean = true;
    let mut note = |res: Result<(), ArchiveError>| match res {
        Ok(()) => Ok(()),
        Err(ArchiveError::Corrupt(_)) => {
            clean = false;
            Ok(())
        }
        Err(e) => Err(e),
    };
    for rec in 0..r.len() {
        // The block check's shortcut accepts only what the whole walk accepts.
        match r.flat_and_walk(rec) {
            Some(true) => {
                FLAT_RECORDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Some(false) => panic!("record {rec}: the shortcut accepts what the walk refuses"),
            None => {}
        }
        // As `lst[i]`'s smallest path reads a record's root (once its block is checked,
        // as `root` just did): the shaped dict that `root` and `item` give, and none where
        // either fails.
        let root = r.root(rec);
        if let Some(s) = r.root_dict_small(rec) {
            let whole = match &root {
                Ok(node) => r.item(*node),
                Err(e) => panic!("root {rec}: {s:?} where {e}"),
            };
            match whole {
                Ok(w) => assert!(w == Item::Dict(s), "root {rec}: {w:?} against {s:?}"),
                Err(e) => panic!("root {rec}: {s:?} where {e}"),
            }
        }
        note(root.and_then(|node| walk(&r, node, 0)))?;
        if r.kind() == Kind::Dict {
            note(r.key(rec).and_then(|k| {
                let found = r.lookup(&k)?;
                // Keys are unique, so a sound table finds each at its own entry.
                if found.is_some_and(|f| f != rec) {
                    return Err(ArchiveError::Corrupt("key found at another entry".into()));
                }
                Ok(())
            }))?;
        }
    }
    let verified = r.validate_all();
    let passed = verified.is_ok();
    note(verified)?;
    // What `verify()` passes, no read refuses (it reads everything as reads do).
    if passed && !clean {
        return Err(ArchiveError::Invalid(
            "verify passed an archive that a read refuses".into(),
        ));
    }
    Ok(clean)
}

/// Whether two items are the same value (floats bit for bit).
fn same_item(a: Item<'_>, b: Item<'_>) -> bool {
    match (a, b) {
        (Item::Float(a), Item::Float(b)) => a.to_bits() == b.to_bits(),
        (a, b) => a == b,
    }
}

/// Read `node`'s value and everything below it as the Python layer does (iteratively:
/// the fuzz thread's stack is small on purpose).
fn walk(r: &Reader<&[u8]>, root: Node, depth: usize) -> Result<(), ArchiveError> {
    let mut stack = vec![(r.item(root)?, depth)];
    while let Some((it, depth)) = stack.pop() {
        if depth > MAX_VALUE_DEPTH + 1 {
            return Err(ArchiveError::Corrupt("nested too deep".into()));
        }
        match it {
            Item::List(n) | Item::Tuple(n) | Item::Dict(n) => {
                // As an unpickled view would: the node rebuilt from (record, position, form).
                let again = r.node_from(n.record() as u64, n.pos(), n.form_code())?;
                assert_eq!(again, n);
            }
            _ => {}
        }
        match it {
            Item::List(n) | Item::Tuple(n) => {
                let _ = r.is_tuple(n);
                let seq = r.seq(n)?;
                for i in 0..seq.len {
                    let item = r.seq_item(n, i)?;
                    // As the iterator makes a list of shaped dicts' items: from the layout.
                    if let Some(node) = seq.struct_item(i) {
                        assert!(
                            item == Item::Dict(node),
                            "struct item {i}: {node:?} against {item:?}"
                        );
                    }
                    // As `ListView` reads a packed field: straight from the node's form.
                    if let super::reader::Form::Pack { elem, .. } = n.form {
                        let direct = r.packed_get(n.pos(), elem, i);
                        // And as its smallest path does: the same element, or none where
                        // `packed_get` fails.
                        let small = r.packed_scalar(n.pos(), elem, i).map(Item::from);
                        match (&direct, small) {
                            (Ok(d), Some(s)) => assert!(same_item(*d, s), "{d:?} against {s:?}"),
                            (Err(_), None) => {}
                            (d, s) => panic!("packed element {i}: {d:?} against {s:?}"),
                        }
                        let direct = direct?;
                        assert!(
                            same_item(direct, item),
                            "packed element {i}: {direct:?} against {item:?}"
                        );
                    }
                    stack.push((item, depth + 1));
                }
            }
            Item::Dict(n) => {
                // As `DictView`'s smallest path reads a shaped dict's field: the value
                // `struct_slot` reads for the kinds it takes, none where that fails.
                if let Some(shape) = r.dict_shape(n).and_then(|id| r.shape_def(id)) {
                    for (&enc, &off) in shape.encs.iter().zip(&shape.offsets) {
                        let whole = r.struct_slot(n, enc, off);
                        let takes = !matches!(
                            enc,
                            Enc::Int(Elem::Bool | Elem::F64) | Enc::Bytes | Enc::Ref
                        );
                        match (&whole, r.struct_slot_small(n, enc, off)) {
                            (Ok(w), Some(s)) => assert!(same_item(*w, s), "{w:?} against {s:?}"),
                            (Ok(w), None) => assert!(!takes, "slot {enc:?}: {w:?} not taken"),
                            (Err(_), None) => {}
                            (Err(e), Some(s)) => panic!("slot {enc:?}: {s:?} where {e}"),
                        }
                        // And a list of shaped dicts behind a reference: the node the slot
                        // gives and the layout `seq` reads of it, none where either fails.
                        if enc == Enc::Ref {
                            if let Some((node, seq)) = r.struct_slot_seq_small(n, off) {
                                let w = whole?;
                                assert!(
                                    w == Item::List(node) || w == Item::Tuple(node),
                                    "slot {w:?} against {node:?}"
                                );
                                assert_eq!(r.seq(node)?, seq, "layout of {node:?}");
                            }
                        }
                    }
                }
                for i in 0..r.dict_len(n)? {
                    let k = r.dict_key(n, i)?;
                    let key = r.item_key(k)?;
                    match r.dict_find(n, &key)? {
                        Some(found) => {
                            r.dict_value(n, found)?;
                        }
                        // As DictView does: a miss is confirmed against a forged index.
                        None if r.dict_indexed(n) => r.confirm_miss(n.record() as u64)?,
                        None => {}
                    }
                    if let Key::Str(s) = &key {
                        r.dict_find_str(n, s)?;
                    }
                    stack.push((k, depth + 1));
                    stack.push((r.dict_value(n, i)?, depth + 1));
                }
            }
            Item::Array(a) => {
                let a = r.array(a)?;
                let data = &r.bytes()[a.offset..a.offset + a.nbytes];
                let _ = (data.first(), data.last());
            }
            Item::BytesExt(ext) => {
                let p = r.payload_checked(ext)?;
                let _ = (p.first(), p.last());
            }
            Item::Sym(id) => {
                r.symbol(id)?;
            }
            // As the Python layer's strict UTF-8 decoding does.
            Item::Str(s) => {
                super::reader::stored_str(s)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Run cases `start..start + n` through [`read_everything`]; panics name the failing seed.
pub fn run(start: u64, n: u64) -> Outcome {
    let mut out = Outcome::default();
    let flat = FLAT_RECORDS.load(std::sync::atomic::Ordering::Relaxed);
    for seed in start..start + n {
        let bytes = case(seed);
        let res = std::panic::catch_unwind(|| read_everything(&bytes));
        match res {
            Ok(Ok(true)) => out.intact += 1,
            Ok(Ok(false)) => out.read_corrupt += 1,
            Ok(Err(
                ArchiveError::Corrupt(_) | ArchiveError::Version(_) | ArchiveError::Unsealed,
            )) => out.open_corrupt += 1,
            Ok(Err(e)) => panic!("fuzz case {seed}: not a corrupt-archive error: {e:?}"),
            Err(_) => panic!("fuzz case {seed}: the reader panicked"),
        }
    }
    out.flat = FLAT_RECORDS.load(std::sync::atomic::Ordering::Relaxed) - flat;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_chains_are_valid_up_to_the_limit() {
        let mut rng = Rng::new(3);
        for depth in [1, 2, 5, 40, MAX_DEPTH] {
            for _ in 0..20 {
                let raw = raw_chain(&mut rng, depth, false);
                let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
                b.finish_raw_record(&raw).unwrap();
                let bytes = b.finish(0).unwrap().0.into_inner();
                let r = Reader::open(&bytes[..]).unwrap();
                assert!(read_everything(&bytes).unwrap(), "depth {depth}");
                // The chain is `depth` containers deep.
                let mut it = r.item(r.root(0).unwrap()).unwrap();
                let mut seen = 0;
                loop {
                    it = match it {
                        Item::List(n) | Item::Tuple(n) => r.seq_item(n, 0).unwrap(),
                        Item::Dict(n) => r.dict_value(n, 0).unwrap(),
                        _ => break,
                    };
                    seen += 1;
                }
                assert_eq!(seen, depth);
            }
        }
    }

    #[test]
    fn cases_are_deterministic() {
        for seed in 0..50 {
            assert_eq!(case(seed), case(seed));
        }
    }
}

/// The bounded run of `cargo test` (CI): `SHMSTORE_FUZZ_CASES` cases (default 20,000) from
/// `SHMSTORE_FUZZ_SEED` (default 0), read in a thread with a 256 KiB stack (a tenth of
/// what Rust gives a thread by default), so the depth limits are tested where recursion
/// would hurt first. `make fuzz` runs it longer.
#[cfg(test)]
#[test]
fn fuzz_cases_never_crash_the_reader() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (start, n) = (
        env("SHMSTORE_FUZZ_SEED", 0),
        env("SHMSTORE_FUZZ_CASES", 20_000),
    );
    let t = std::time::Instant::now();
    let out = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || run(start, n))
        .unwrap()
        .join()
        .expect("a fuzz case failed (see the message above)");
    eprintln!(
        "fuzz: {n} cases from seed {start} in {:.1} s: {out:?}",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(out.open_corrupt + out.read_corrupt + out.intact, n);
    // The generator must reach every outcome, or it tests less than it claims.
    if n >= 1000 {
        assert!(out.open_corrupt > n / 50 && out.read_corrupt > n / 20 && out.intact > n / 20);
    }
}

/// Named hostile archives (tests/test_hostile_bytes.py): one per attack that once crashed
/// or raised the wrong exception, or that the format must refuse. `None` for an unknown
/// name. Every one is corrupt except those whose name ends in `-ok`.
pub fn crafted(name: &str) -> Option<(Kind, Vec<u8>)> {
    let seal = |b: Builder<Cursor<Vec<u8>>>| b.finish(0).expect("in memory").0.into_inner();
    let object = |v: Value| {
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
        b.finish_record(&v).expect("in memory");
        seal(b)
    };
    let raw = |bytes: &[u8]| {
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
        b.finish_raw_record(bytes).expect("in memory");
        seal(b)
    };
    let array = |typestr: &str, shape: Vec<u64>, len: u64| {
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
        let data = b.write_payload(&vec![0; len as usize]).expect("in memory");
        let v = Value::Array(Box::new(ArrayMeta {
            typestr: typestr.into(),
            shape,
            data,
        }));
        b.finish_record(&v).expect("in memory");
        seal(b)
    };
    let chain = |depth: usize, keys: bool| {
        let mut rng = Rng::new(depth as u64);
        let bytes = if keys {
            raw_chain(&mut rng, depth, true)
        } else {
            let mut out = Vec::new();
            for _ in 0..depth {
                out.extend_from_slice(&[T_LIST, 1, 4, 0, 0, 0]);
            }
            out.push(T_NONE);
            out
        };
        raw(&bytes)
    };
    // Edit the first record's bytes at `at` (from its start), then reseal.
    let edit = |mut b: Vec<u8>, at: usize, with: &[u8]| {
        let (s, _) = header::record_span(&b, u64_at(&b, 32), 0).expect("a record");
        let at = s as usize + at;
        b[at..at + with.len()].copy_from_slice(with);
        header::reseal(&mut b);
        b
    };
    let str_list = || Value::List(vec![Value::Str("a".into()), Value::Str("b".into())]);
    let bytes = match name {
        // A list nested 45,000 deep: a few hundred KiB that used to overflow the stack.
        "deep" => chain(45_000, false),
        "deep-mixed" => chain(30_000, true),
        // One level past what a writer makes.
        "deep-limit" => chain(MAX_DEPTH + 1, false),
        // As deep as a writer makes: valid (and `put` takes it back).
        "deep-ok" => chain(MAX_DEPTH, false),
        // A dict as deep as a writer makes, whose key is tuples nested as deep as a key may
        // be: valid; one tuple more is not.
        "deep-key-ok" => object(deep_key(MAX_KEY_DEPTH)),
        "deep-key-limit" => object(deep_key(MAX_KEY_DEPTH + 1)),
        "typestr-non-ascii" => array("<\u{e9}8", vec![1], 8),
        "typestr-non-ascii-2" => array("\u{e9}f8", vec![1], 8),
        "empty-huge-shape" => array("<f8", vec![0, 1 << 62], 0),
        "empty-huge-shape-2" => array("|u1", vec![u64::MAX, 0], 0),
        "too-many-dims" => array("<f8", vec![1; 65], 8),
        "list-key" => object(Value::Dict(vec![(Value::List(vec![]), Value::None)])),
        "list-in-tuple-key" => object(Value::Dict(vec![(
            Value::Tuple(vec![Value::Int(1), Value::List(vec![])]),
            Value::None,
        )])),
        // A symbol id past the symbol table.
        "sym-out-of-range" => raw(&[T_LIST, 1, 4, 0, 0, 0, T_SYM, 7]),
        // A dict of 9 entries whose hash index is all empty: every lookup would miss.
        "forged-index-hides-keys" => {
            let v = Value::Dict(
                (0..9)
                    .map(|i| (Value::Int(i * 1000), Value::Int(i)))
                    .collect(),
            );
            let b = object(v);
            // tag, count, 18 refs, then the index (32 slots of u32).
            edit(b, 2 + 18 * REF, &[0; 32 * 4])
        }
        // A big-int key holding a small int (writers store ints): never found by lookup.
        "bigint-key-fits-i64" => object(Value::Dict(vec![(
            Value::BigInt(vec![0x87; 3]),
            Value::None,
        )])),
        // Two references to one value (a DAG): work would grow exponentially with depth.
        "shared-child" => {
            let b = object(str_list());
            // refs at 2 and 6; make the second name the first's target (distance - 4).
            let (s, _) = header::record_span(&b, u64_at(&b, 32), 0).expect("a record");
            let first = u32::from_le_bytes(b[s as usize + 2..s as usize + 6].try_into().unwrap());
            edit(b, 6, &(first - 4).to_le_bytes())
        }
        // A reference of 0 (the value would contain itself).
        "self-reference" => edit(object(str_list()), 2, &0u32.to_le_bytes()),
        // A shape id past the shape table.
        "shape-out-of-range" => raw(&[T_DICT_SHAPED, 9, 0, 0, 0, 0]),
        // A varint count that does not fit: 2^63 items.
        "huge-count" => raw(&[
            T_LIST, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
        ]),
        "span-start-near-2^64" | "span-length-long" => {
            let mut b = object(Value::Str("x".into()));
            let index_off = u64_at(&b, 32) as usize;
            let e = if name.contains("start") {
                (u64::MAX - 7) << 16 | 3
            } else {
                u64_at(&b, index_off) | 0xFFFF
            };
            b[index_off..index_off + 8].copy_from_slice(&e.to_le_bytes());
            header::reseal(&mut b);
            b
        }
        // Three strings whose bytes overlap: each reference points past the one before
        // it, but each value runs to the record's end. A record of n bytes would make
        // ~n^2/4 bytes of Python objects.
        "overlapping-values" => {
            let mut rec = vec![T_LIST, 3];
            for (at, target) in [(2u32, 14u32), (6, 16), (10, 18)] {
                rec.extend_from_slice(&(target - at).to_le_bytes());
            }
            let end = 14 + 100;
            for k in 0..3u8 {
                let p = 14 + 2 * k as usize;
                rec.resize(p, 0);
                rec.extend_from_slice(&[T_BYTES, (end - p - 2) as u8]);
            }
            rec.resize(end, 0);
            raw(&rec)
        }
        // Two values naming one out-of-line payload: bytes copied out twice (or n times).
        "shared-payload" => {
            let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
            let data = b.write_payload(&[7; 70_000]).expect("in memory");
            let v = Value::List(vec![Value::BytesExt(data), Value::BytesExt(data)]);
            b.finish_record(&v).expect("in memory");
            seal(b)
        }
        // A list of 2^40 dicts whose every field is None: rows of 0 bytes, so the count
        // fits in any record, and reading it whole would never end.
        "zero-size-rows" => {
            let row = || Value::Dict(vec![(Value::Str("a".into()), Value::None)]);
            let v = Value::List(vec![
                Value::List(vec![row(), row()]),
                Value::Str("x".repeat(20)),
            ]);
            // [T_LIST, 2, ref -> 10, ref -> 13, T_LIST_STRUCT, shape, 2, T_STR, 20, x...]:
            // the count becomes 2^40 (6 bytes), the second reference a None after it.
            let b = edit(object(v), 12, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x20, T_NONE]);
            edit(b, 6, &12u32.to_le_bytes())
        }
        // The same as a field of a shaped dict, which the block check's shortcut takes:
        // {"rows": [{"a": None}] * 2, "s": "x" * 20} is written
        // [T_DICT_SHAPED, 0, ref -> 10, str ref -> 20, T_LIST, 2, ref, ref, 20, x..., rows];
        // at 10 the rows become one of no bytes counted 2^40, the str a short one after it.
        "zero-size-rows-in-a-dict" => {
            let row = || Value::Dict(vec![(Value::Str("a".into()), Value::None)]);
            let v = Value::Dict(vec![
                (Value::Str("rows".into()), Value::List(vec![row(), row()])),
                (Value::Str("s".into()), Value::Str("x".repeat(20))),
            ]);
            let rows = [
                T_LIST_STRUCT,
                1,
                0x80,
                0x80,
                0x80,
                0x80,
                0x80,
                0x20,
                1,
                b'x',
            ];
            let b = edit(object(v), 10, &rows);
            edit(b, 6, &12u32.to_le_bytes())
        }
        // A list of strs in a shaped dict, whose values the block check's shortcut checks
        // in its second pass: the list's second reference points into the first str, at
        // bytes that read as a str of their own (forward of the first, overlapping it).
        "overlapping-values-in-an-inner-list" => {
            let v = Value::Dict(vec![(
                Value::Str("tags".into()),
                Value::List(vec![
                    Value::Str("a\n\x03abcdefghijklmnop".into()),
                    Value::Str("y".repeat(20)),
                ]),
            )]);
            let b = object(v);
            let (s, _) = header::record_span(&b, u64_at(&b, 32), 0).expect("a record");
            let rec = &b[s as usize..];
            let list = rec
                .windows(2)
                .position(|w| w == [T_LIST, 2])
                .expect("the list");
            let first_ref = list + 2;
            let first = first_ref + super::u32_at(rec, first_ref) as usize;
            // The first str is [T_STR, 19, 'a', T_STR, 3, ...]: a str of 3 at `first + 3`.
            let second_ref = first_ref + 4;
            let to = (first + 3 - second_ref) as u32;
            edit(b, second_ref, &to.to_le_bytes())
        }
        // A shape naming one key twice (a writer never makes one): `len()` of its dicts
        // said 2 and `to_python()` held one entry. The same symbol twice, or two symbols
        // of one string.
        "shape-key-twice" | "shape-key-twice-by-name" => {
            let mut b = object(Value::Dict(vec![
                (Value::Str("a".into()), Value::Int(1)),
                (Value::Str("b".into()), Value::Int(2)),
            ]));
            let shapes = u64_at(&b, 56) as usize;
            if name == "shape-key-twice" {
                // The shape count (u32), the first shape's field count (u16), its fields
                // (key u32, encoding 4 bytes): the second field's key becomes the first's.
                let at = shapes + 4 + 2;
                let first: [u8; 4] = b[at..at + 4].try_into().expect("4 bytes");
                b[at + 8..at + 12].copy_from_slice(&first);
            } else {
                // The symbol "b" becomes a second "a".
                let syms = u64_at(&b, 48) as usize;
                let n = u32::from_le_bytes(b[syms..syms + 4].try_into().expect("4 bytes"));
                let blob = syms + 4 + (n as usize + 1) * 4;
                let at = blob + b[blob..shapes].iter().position(|&c| c == b'b').expect("b");
                b[at] = b'a';
            }
            header::reseal(&mut b);
            b
        }
        // A dict of the general layout holding one key twice in Python's sense (`1` and
        // `True`; with more than 8 entries, and so an index, `2` and `2.0`): no writer
        // stores one (it comes from a Python dict), and `len()` would say one entry more
        // than `to_python()` gives.
        "general-key-twice" => object(Value::Dict(vec![
            (Value::Int(1), Value::Int(1)),
            (Value::Bool(true), Value::Int(2)),
        ])),
        "general-key-twice-indexed" => object(Value::Dict(
            (0..10)
                .map(|i| (Value::Int(i), Value::Int(i)))
                .chain([(Value::Float(2.0), Value::Int(-1))])
                .collect(),
        )),
        "general-keys-ok" => object(Value::Dict(
            (0..10)
                .map(|i| (Value::Int(i), Value::Int(i)))
                .chain([
                    (Value::Float(2.5), Value::Int(-1)),
                    (Value::Str("2".into()), Value::Int(-2)),
                    (Value::Tuple(vec![Value::Int(2)]), Value::Int(-3)),
                ])
                .collect(),
        )),
        "payload-extent-near-2^64" => object(Value::BytesExt(Extent {
            offset: u64::MAX - 7,
            len: 16,
            checksum: 0,
        })),
        _ => return None,
    };
    Some((Kind::Object, bytes))
}

/// A record of lists nested `MAX_DEPTH - 1` deep around a dict (the writer's deepest
/// container) whose one key is `tuples` tuples one in another around an int.
pub fn deep_key(tuples: usize) -> Value {
    let mut key = Value::Int(7);
    for _ in 0..tuples {
        key = Value::Tuple(vec![key]);
    }
    let mut v = Value::Dict(vec![(key, Value::Str("deepest".into()))]);
    for _ in 0..MAX_DEPTH - 1 {
        v = Value::List(vec![v]);
    }
    v
}

/// The names [`crafted`] knows; those ending in `-ok` are valid, every other is corrupt.
pub const CRAFTED: &[&str] = &[
    "deep",
    "deep-mixed",
    "deep-limit",
    "deep-ok",
    "deep-key-limit",
    "deep-key-ok",
    "typestr-non-ascii",
    "typestr-non-ascii-2",
    "empty-huge-shape",
    "empty-huge-shape-2",
    "too-many-dims",
    "list-key",
    "list-in-tuple-key",
    "sym-out-of-range",
    "forged-index-hides-keys",
    "bigint-key-fits-i64",
    "shared-child",
    "self-reference",
    "shape-out-of-range",
    "huge-count",
    "span-start-near-2^64",
    "span-length-long",
    "payload-extent-near-2^64",
    "overlapping-values",
    "shared-payload",
    "zero-size-rows",
    "zero-size-rows-in-a-dict",
    "overlapping-values-in-an-inner-list",
    "shape-key-twice",
    "shape-key-twice-by-name",
    "general-key-twice",
    "general-key-twice-indexed",
    "general-keys-ok",
];

#[cfg(test)]
#[test]
fn crafted_attacks_are_corrupt_not_crashes() {
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            for name in CRAFTED {
                let (_, bytes) = crafted(name).unwrap();
                let res = std::panic::catch_unwind(|| read_everything(&bytes));
                match res {
                    Ok(Ok(true)) => assert!(name.ends_with("-ok"), "{name} read as intact"),
                    Ok(Ok(false) | Err(ArchiveError::Corrupt(_))) => {
                        assert!(!name.ends_with("-ok"), "{name} is valid")
                    }
                    Ok(Err(e)) => panic!("{name}: {e:?}"),
                    Err(_) => panic!("{name}: the reader panicked"),
                }
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
