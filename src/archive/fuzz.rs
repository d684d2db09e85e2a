//! Structure-aware fuzzing of the reader: archives whose checksums are right but whose
//! structure is arbitrary (docs/security.md, "Fuzzing").
//!
//! [`case`] makes one archive from a seed, deterministically:
//! 1. records built through the real [`Builder`] from generated `Value` trees, including
//!    values no writer makes (any value in a dict's key position, symbol ids out of range,
//!    array metadata with any typestr, shape and extent, hash indexes with any entries,
//!    odd-length dicts, payload extents anywhere);
//! 2. raw records crafted byte by byte: chains of containers nested from just under to far
//!    over the format's depth limit (tens of thousands of levels, which no `Value` could be
//!    serialized from without deep recursion);
//! 3. then, for some cases, edits of the bytes: record bytes (tags, relative pointers,
//!    lengths), index entries (span ends near 2^64), symbols, keys, dict table, header;
//! 4. and [`header::reseal`] recomputes every checksum, so only the structural checks stand
//!    between the bytes and the readers.
//!
//! [`read_everything`] then goes through every read path of the Rust reader; the Python
//! tests (tests/test_fuzz.py) take the same cases through `_native._fuzz_case` and every
//! Python read path. The contract under test: a result or `ArchiveError::Corrupt`, never a
//! panic, a crash or a hang.
//!
//! A new format version extends this file where it knows the format: [`raw_chain`] (the
//! byte layout of a container value) and the metadata edits in [`mutate`]; the generators
//! of `Value`s follow the value model.

use std::io::Cursor;

use super::header::{self, Kind, HEADER_LEN, INDEX_ENTRY};
use super::key::Key;
use super::reader::{Node, Reader};
use super::value::{
    ArchivedValue, ArrayMeta, Extent, IndexedDict, Value, MAX_SUBTREE_DEPTH, MAX_VALUE_DEPTH,
};
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
        5 => Value::Sym(rng.below(6) as u32), // sometimes out of range
        6 if depth < 40 => {
            Value::Tuple((0..rng.below(3)).map(|_| gen_key(rng, depth + 1)).collect())
        }
        _ => Value::Str(gen_str(rng)),
    }
}

/// The `Key` of a generated key value, as a reader would see it (symbols: those `build`
/// interns); `None` for a value that cannot be a key.
fn value_key(v: &Value) -> Option<Key<'static>> {
    Some(match v {
        Value::None => Key::None,
        Value::Bool(b) => Key::Bool(*b),
        Value::Int(i) => Key::Int(*i),
        Value::Float(f) => Key::Float(*f),
        Value::Str(s) => Key::Str(s.clone().into()),
        Value::Sym(id) => Key::Str(SYMBOLS.get(*id as usize)?.to_string().into()),
        Value::Bytes(b) => Key::Bytes(b.clone().into()),
        Value::Tuple(items) => Key::Tuple(items.iter().map(value_key).collect::<Option<_>>()?),
        _ => return None,
    })
}

/// The strings `build` interns, in order (symbol ids 0, 1, 2).
const SYMBOLS: &[&str] = &["id", "é", "name"];

/// A payload for an array or out-of-line bytes; its extent is sometimes replaced.
fn gen_extent(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>, len: u64) -> Extent {
    let mut ext = if len <= 4096 && rng.pct(80) {
        b.write_payload(&vec![0x5a; len as usize])
            .unwrap_or(Extent { offset: 0, len })
    } else {
        Extent { offset: 0, len }
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

/// A value tree: what writers make, plus (with small probabilities) what they never make.
fn gen_value(rng: &mut Rng, b: &mut Builder<Cursor<Vec<u8>>>, depth: usize) -> Value {
    let leaf = depth >= 6 || rng.pct(35);
    if leaf {
        return match rng.below(12) {
            0 => Value::None,
            1 => Value::Bool(rng.pct(50)),
            2 => Value::Int(rng.u64() as i64),
            3 => Value::BigInt(vec![rng.u64() as u8; rng.below(20) as usize]),
            4 => Value::Float(f64::from_bits(rng.u64())),
            5 => Value::Complex(Box::new([1.5, f64::NAN])),
            6 => Value::Str(gen_str(rng)),
            7 => Value::Sym(rng.below(6) as u32),
            8 => Value::Bytes(vec![7; rng.below(10) as usize]),
            9 => {
                let len = rng.below(200);
                Value::BytesExt(Box::new(gen_extent(rng, b, len)))
            }
            _ => gen_array(rng, b),
        };
    }
    let n = rng.below(5) as usize;
    match rng.below(5) {
        0 => Value::List((0..n).map(|_| gen_value(rng, b, depth + 1)).collect()),
        1 => Value::Tuple((0..n).map(|_| gen_value(rng, b, depth + 1)).collect()),
        k => {
            let n = if k == 4 { 9 + rng.below(4) as usize } else { n };
            let mut items = Vec::with_capacity(2 * n);
            for _ in 0..n {
                // Now and then anything at all in a key position (a list, a dict, ...).
                let key = if rng.pct(10) {
                    gen_value(rng, b, depth + 1)
                } else {
                    gen_key(rng, 0)
                };
                items.push(key);
                items.push(gen_value(rng, b, depth + 1));
            }
            if rng.pct(5) {
                items.push(Value::None); // a key without its value
            }
            if k == 4 {
                // Half the time the index a writer would make (so lookups, hits and misses,
                // run their real course), else a forged one.
                let hashes: Option<Vec<u64>> = items
                    .iter()
                    .step_by(2)
                    .map(|k| value_key(k).map(|k| k.stable_hash()))
                    .collect();
                if let Some(hashes) = hashes.filter(|_| rng.pct(50)) {
                    let index = super::table::record_index(&hashes);
                    return Value::IndexedDict(Box::new(IndexedDict { items, index }));
                }
                let cap = if rng.pct(85) {
                    (2 * n).next_power_of_two()
                } else {
                    rng.below(40) as usize
                };
                let index = (0..cap)
                    .map(|_| match rng.below(4) {
                        0 => 0,
                        1 => rng.u64() as u32,
                        _ => rng.below(n as u64 + 2) as u32,
                    })
                    .collect();
                Value::IndexedDict(Box::new(IndexedDict { items, index }))
            } else {
                Value::Dict(items)
            }
        }
    }
}

/// Size of an archived `Value` and where a container's fields sit in it: a tag byte, then
/// a relative pointer (i32, from the pointer's own position) and a length (u32). Checked
/// against rkyv's real output by `raw_layout_matches_rkyv` below.
const VALUE: usize = 9;

fn tag_of(v: &Value) -> u8 {
    let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(v).expect("serialize");
    bytes[bytes.len() - VALUE]
}

/// rkyv bytes of `depth` containers nested in one another around a `None` (root last).
/// Each level is a list, a tuple or a small dict (whose other item is a `None`, the child
/// in the key or the value position).
/// `keys`: let a dict's child sit in its key position now and then (a malformed record).
pub fn raw_chain(rng: &mut Rng, depth: usize, keys: bool) -> Vec<u8> {
    let none = rkyv::to_bytes::<rkyv::rancor::Error>(&Value::None).expect("serialize");
    let tags = [
        tag_of(&Value::List(vec![])),
        tag_of(&Value::Tuple(vec![])),
        tag_of(&Value::Dict(vec![])),
    ];
    let kinds: Vec<u8> = (0..depth).map(|_| rng.below(3) as u8).collect();
    let child_is_key: Vec<bool> = (0..depth).map(|_| keys && rng.pct(20)).collect();
    let mut out = Vec::with_capacity((depth + 1) * 2 * VALUE);
    // Level i's items must be contiguous: its extra `None` (a dict's other item) goes
    // right before or after the child value, which is written first.
    let mut child_start; // where level i's items begin
    let emit_none = |out: &mut Vec<u8>| out.extend_from_slice(&none);
    // Level 0 (the innermost container) holds the leaf.
    if kinds.first() == Some(&2) && !child_is_key[0] {
        child_start = out.len();
        emit_none(&mut out); // key
        emit_none(&mut out); // the leaf
    } else {
        child_start = out.len();
        emit_none(&mut out); // the leaf
        if kinds.first() == Some(&2) {
            emit_none(&mut out); // value after the key
        }
    }
    for i in 0..depth {
        let is_dict = kinds[i] == 2;
        let next_dict = kinds.get(i + 1) == Some(&2);
        let next_key = child_is_key.get(i + 1).copied().unwrap_or(false);
        // The next level's items: [None, this] or [this, None] or [this].
        let next_start = if next_dict && !next_key {
            let s = out.len();
            emit_none(&mut out);
            s
        } else {
            out.len()
        };
        let pos = out.len();
        out.push(tags[kinds[i] as usize]);
        let rel = child_start as i64 - (pos as i64 + 1);
        out.extend_from_slice(&(rel as i32).to_le_bytes());
        out.extend_from_slice(&(if is_dict { 2u32 } else { 1 }).to_le_bytes());
        if next_dict && next_key {
            emit_none(&mut out);
        }
        child_start = next_start;
        if i + 1 == depth {
            // The root must be last: drop a trailing `None` written for a next level.
            out.truncate(pos + VALUE);
        }
    }
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
        0 => MAX_VALUE_DEPTH - 1 + rng.below(4) as usize,
        1 => MAX_SUBTREE_DEPTH - 2 + rng.below(5) as usize,
        2 => 300 + rng.below(300) as usize,
        3 => 20_000 + rng.below(25_000) as usize,
        _ => 1 + rng.below(40) as usize,
    }
}

fn build(rng: &mut Rng, kind: Kind) -> Vec<u8> {
    let mut b = Builder::new(Cursor::new(Vec::new()), kind, 1).expect("in memory");
    for s in SYMBOLS {
        b.intern(s);
    }
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
            // Record bytes: a tag, a pointer, a length or any byte.
            0..=4 if index_off > HEADER_LEN && index_off <= len => {
                let at = HEADER_LEN + rng.below((index_off - HEADER_LEN) as u64) as usize;
                match rng.below(4) {
                    0 => b[at] = rng.below(20) as u8,
                    1 => put_u32(b, at, rng.pick(EDGES_U32)),
                    2 => put_u32(b, at, rng.u64() as u32),
                    _ => b[at] ^= 1 << rng.below(8),
                }
            }
            // An index entry: span start or end.
            5 if count > 0 => {
                let e = index_off + rng.below(count as u64) as usize * INDEX_ENTRY;
                let field = e + 8 * rng.below(2) as usize;
                let v = if rng.pct(50) {
                    edge_u64(rng)
                } else {
                    u64_at(b, field.min(len - 8))
                        .wrapping_add(rng.below(32))
                        .wrapping_sub(16)
                };
                put_u64(b, field, v);
            }
            // The header fields (counts, regions, kind, version).
            6 => {
                let at = 8 * (1 + rng.below(11) as usize);
                if rng.pct(50) {
                    put_u64(b, at, edge_u64(rng));
                } else {
                    b[at] = b[at].wrapping_add(1 + rng.below(3) as u8);
                }
            }
            // Metadata (symbols, keys, table): a u32, a u64 or a byte.
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
}

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
        note(r.root(rec).and_then(|node| walk(&r, node, node, 0)))?;
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
    note(r.validate_all())?;
    Ok(clean)
}

/// Read `node`'s value and everything below it as the Python layer does.
fn walk(r: &Reader<&[u8]>, root: Node, node: Node, depth: usize) -> Result<(), ArchiveError> {
    if depth > MAX_VALUE_DEPTH {
        return Err(ArchiveError::Corrupt("nested too deep".into()));
    }
    // As an unpickled view would: the position re-validated from (record, pos).
    let again = r.node_checked(root.record() as u64, node.pos())?;
    assert_eq!(again, node);
    match r.get(node) {
        ArchivedValue::List(items) | ArchivedValue::Tuple(items) => {
            for it in items.iter() {
                walk(r, root, r.child(node, it), depth + 1)?;
            }
        }
        v @ (ArchivedValue::Dict(_) | ArchivedValue::IndexedDict(_)) => {
            let (items, index) = match v {
                ArchivedValue::Dict(items) => (items.as_slice(), &[][..]),
                ArchivedValue::IndexedDict(d) => (d.items.as_slice(), d.index.as_slice()),
                _ => unreachable!(),
            };
            for (i, pair) in items.chunks(2).enumerate() {
                let key = r.value_key(&pair[0])?;
                match r.dict_find(items, index, &key)? {
                    Some(found) => {
                        let _ = items.get(2 * found + 1);
                    }
                    // As DictView does: a miss is confirmed against a forged index.
                    None if !index.is_empty() => r.confirm_miss(root.record() as u64)?,
                    None => {}
                }
                if let Key::Str(s) = &key {
                    r.dict_find_str(items, index, s)?;
                }
                walk(r, root, r.child(node, &pair[0]), depth + 1)?;
                if let Some(v) = pair.get(1) {
                    walk(r, root, r.child(node, v), depth + 1)?;
                }
                let _ = i;
            }
        }
        ArchivedValue::Array(meta) => {
            let a = r.array(node, meta)?;
            let data = &r.bytes()[a.offset..a.offset + a.nbytes];
            let _ = (data.first(), data.last());
        }
        ArchivedValue::BytesExt(ext) => {
            let p = r.payload(node, ext)?;
            let _ = (p.first(), p.last());
        }
        ArchivedValue::Sym(id) => {
            r.symbol(id.to_native())?;
        }
        _ => {}
    }
    Ok(())
}

/// Run cases `start..start + n` through [`read_everything`]; panics name the failing seed.
pub fn run(start: u64, n: u64) -> Outcome {
    let mut out = Outcome::default();
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
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_layout_matches_rkyv() {
        let v = Value::List(vec![Value::None]);
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&v).unwrap();
        assert_eq!(bytes.len(), 2 * VALUE);
        let root = VALUE;
        assert_eq!(bytes[root], tag_of(&Value::List(vec![])));
        let rel = i32::from_le_bytes(bytes[root + 1..root + 5].try_into().unwrap());
        assert_eq!(rel, -(root as i32 + 1));
        assert_eq!(
            u32::from_le_bytes(bytes[root + 5..root + 9].try_into().unwrap()),
            1
        );
    }

    #[test]
    fn raw_chains_are_valid_below_the_limit() {
        let mut rng = Rng::new(3);
        for depth in [1, 2, 5, 40, MAX_VALUE_DEPTH] {
            for _ in 0..20 {
                let raw = raw_chain(&mut rng, depth, false);
                let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).unwrap();
                b.finish_raw_record(&raw).unwrap();
                let bytes = b.finish(0).unwrap().0.into_inner();
                let r = Reader::open(&bytes[..]).unwrap();
                r.validate_record(0).unwrap();
                // The chain is `depth` containers deep.
                let mut node = r.root(0).unwrap();
                let mut seen = 0;
                loop {
                    let items = match r.get(node) {
                        ArchivedValue::List(i) | ArchivedValue::Tuple(i) => i.as_slice(),
                        ArchivedValue::Dict(i) => i.as_slice(),
                        _ => break,
                    };
                    seen += 1;
                    let next = items
                        .iter()
                        .find(|v| !matches!(v, ArchivedValue::None))
                        .unwrap_or(&items[0]);
                    node = r.child(node, next);
                    if items.iter().all(|v| matches!(v, ArchivedValue::None)) {
                        break;
                    }
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

/// Named hostile archives (tests/test_hostile.py): one per attack that once crashed or
/// raised the wrong exception. `None` for an unknown name.
pub fn crafted(name: &str) -> Option<(Kind, Vec<u8>)> {
    let object = |v: Value| {
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
        b.finish_record(&v).expect("in memory");
        b.finish(0).expect("in memory").0.into_inner()
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
        b.finish(0).expect("in memory").0.into_inner()
    };
    let chain = |depth: usize, kinds: u8| {
        // Lists only (kinds 0) or a mix of lists, tuples and dicts.
        let mut rng = Rng::new(depth as u64);
        let raw = if kinds == 0 {
            let mut out = rkyv::to_bytes::<rkyv::rancor::Error>(&Value::None)
                .expect("serialize")
                .to_vec();
            let tag = tag_of(&Value::List(vec![]));
            for i in 0..depth {
                out.push(tag);
                out.extend_from_slice(&(-(VALUE as i32) - 1).to_le_bytes());
                out.extend_from_slice(&1u32.to_le_bytes());
                debug_assert_eq!(out.len(), (i + 2) * VALUE);
            }
            out
        } else {
            raw_chain(&mut rng, depth, true)
        };
        let mut b = Builder::new(Cursor::new(Vec::new()), Kind::Object, 1).expect("in memory");
        b.finish_raw_record(&raw).expect("in memory");
        b.finish(0).expect("in memory").0.into_inner()
    };
    let bytes = match name {
        // A list nested 45,000 deep: a few hundred KiB that used to overflow the stack.
        "deep" => chain(45_000, 0),
        "deep-mixed" => chain(30_000, 1),
        // Just past the format's limit, yet within what validation walks.
        "deep-limit" => chain(MAX_VALUE_DEPTH + 1, 0),
        // At the limit: valid.
        "deep-ok" => chain(MAX_VALUE_DEPTH, 0),
        "typestr-non-ascii" => array("<\u{e9}8", vec![1], 8),
        "typestr-non-ascii-2" => array("\u{e9}f8", vec![1], 8),
        "empty-huge-shape" => array("<f8", vec![0, 1 << 62], 0),
        "empty-huge-shape-2" => array("|u1", vec![u64::MAX, 0], 0),
        "too-many-dims" => array("<f8", vec![1; 65], 8),
        "list-key" => object(Value::Dict(vec![Value::List(vec![]), Value::None])),
        "list-in-tuple-key" => object(Value::Dict(vec![
            Value::Tuple(vec![Value::Int(1), Value::List(vec![])]),
            Value::None,
        ])),
        "dict-key-without-value" => object(Value::Dict(vec![
            Value::Str("a".into()),
            Value::Int(1),
            Value::Str("b".into()),
        ])),
        "sym-out-of-range" => object(Value::List(vec![Value::Sym(7)])),
        // An indexed dict whose index is empty: every lookup would miss its keys.
        "forged-index-hides-keys" => object(Value::IndexedDict(Box::new(IndexedDict {
            items: (0..9)
                .flat_map(|i| [Value::Str(format!("k{i}")), Value::Int(i)])
                .collect(),
            index: vec![0; 32],
        }))),
        // A big-int key holding a small int (writers store `Int`): never found by lookup.
        "bigint-key-fits-i64" => {
            object(Value::Dict(vec![Value::BigInt(vec![0x87; 3]), Value::None]))
        }
        "span-start-near-2^64" | "span-end-near-2^64" => {
            let mut b = object(Value::Str("x".into()));
            let index_off = u64_at(&b, 32) as usize;
            let at = index_off + if name.contains("start") { 0 } else { 8 };
            b[at..at + 8].copy_from_slice(&(u64::MAX - 7).to_le_bytes());
            header::reseal(&mut b);
            b
        }
        "payload-extent-near-2^64" => object(Value::BytesExt(Box::new(Extent {
            offset: u64::MAX - 7,
            len: 16,
        }))),
        _ => return None,
    };
    Some((Kind::Object, bytes))
}

/// The names [`crafted`] knows.
pub const CRAFTED: &[&str] = &[
    "deep",
    "deep-mixed",
    "deep-limit",
    "deep-ok",
    "typestr-non-ascii",
    "typestr-non-ascii-2",
    "empty-huge-shape",
    "empty-huge-shape-2",
    "too-many-dims",
    "list-key",
    "list-in-tuple-key",
    "dict-key-without-value",
    "sym-out-of-range",
    "forged-index-hides-keys",
    "bigint-key-fits-i64",
    "span-start-near-2^64",
    "span-end-near-2^64",
    "payload-extent-near-2^64",
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
                    Ok(Ok(true)) => assert_eq!(*name, "deep-ok", "{name} read as intact"),
                    Ok(Ok(false) | Err(ArchiveError::Corrupt(_))) => {
                        assert_ne!(*name, "deep-ok", "{name} is valid")
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
