//! The record encoder: one `Value` tree -> the bytes of one record (docs/format.md,
//! "Records"). It owns what records share, the symbol table and the shapes, and lays
//! every record out breadth first: the root value at offset 0, then its children in
//! order, so every reference points forward and a record reads front to back.
//!
//! Shapes are decided while streaming: a dict's key set (in order) and the narrowest
//! encoding of each of its values are joined with the current shape of that key set; if
//! the join is wider, it becomes a new shape (a new version of the key set) and the
//! current one for later dicts. Nothing is ever re-encoded, so there is no second pass.

use std::collections::VecDeque;

use ahash::AHashMap;

use super::format::*;
use super::key::Key;
use super::value::{dict_has_index, Value};
use super::{table, ArchiveError};

/// Most distinct strings the symbol table interns; later new keys are stored inline.
pub const MAX_SYMBOLS: usize = 1 << 16;
/// Longest str that is interned as a symbol.
pub const MAX_SYMBOL_LEN: usize = 128;

enum Job<'v> {
    /// A tagged value.
    Tagged(&'v Value),
    /// A general dict's key: a str is written as a symbol when it can be interned.
    Key(&'v Value),
    /// The body of a `Str`/`Bytes` field: varint length + bytes.
    Blob(&'v [u8]),
}

/// A reference waiting for its target: the position of its 4 bytes and what to write.
struct Pending<'v> {
    at: usize,
    job: Job<'v>,
}

pub struct Encoder {
    symbols: AHashMap<Box<str>, u32>,
    symbol_list: Vec<Box<str>>,
    shapes: Vec<Shape>,
    current: AHashMap<Box<[u32]>, u32>,
    out: Vec<u8>,
    keys: Vec<u32>,
    encs: Vec<Enc>,
}

impl Default for Encoder {
    fn default() -> Self {
        Encoder {
            symbols: AHashMap::with_hasher(super::map_hasher()),
            symbol_list: Vec::new(),
            shapes: Vec::new(),
            current: AHashMap::with_hasher(super::map_hasher()),
            out: Vec::new(),
            keys: Vec::new(),
            encs: Vec::new(),
        }
    }
}

/// Symbol `id` of `list` (`Invalid` for an id the encoder never gave out).
fn symbol_in(list: &[Box<str>], id: u32) -> Result<&str, ArchiveError> {
    list.get(id as usize)
        .map(|s| s.as_ref())
        .ok_or_else(|| ArchiveError::Invalid(format!("symbol {id} was never interned")))
}

fn too_big() -> ArchiveError {
    ArchiveError::Invalid(
        "a record's structure is larger than 4 GiB (arrays and bytes over 64 KiB are stored \
         apart and do not count): split the record"
            .into(),
    )
}

impl Encoder {
    pub fn symbols(&self) -> &[Box<str>] {
        &self.symbol_list
    }

    pub fn shapes(&self) -> &[Shape] {
        &self.shapes
    }

    /// Intern a string (dict keys); `None` when it is too long or the table is full.
    pub fn intern(&mut self, s: &str) -> Option<u32> {
        if let Some(&id) = self.symbols.get(s) {
            return Some(id);
        }
        if s.len() > MAX_SYMBOL_LEN || self.symbol_list.len() >= MAX_SYMBOLS {
            return None;
        }
        let id = self.symbol_list.len() as u32;
        let boxed: Box<str> = s.into();
        self.symbols.insert(boxed.clone(), id);
        self.symbol_list.push(boxed);
        Some(id)
    }

    /// The str of an interned symbol (`Invalid` for an id this encoder never gave out).
    fn symbol(&self, id: u32) -> Result<&str, ArchiveError> {
        symbol_in(&self.symbol_list, id)
    }

    /// `key_of`, with interned symbols resolved.
    fn key_of<'v>(&'v self, v: &'v Value) -> Option<Key<'v>> {
        match v {
            Value::Sym(id) => Some(Key::Str(std::borrow::Cow::Borrowed(self.symbol(*id).ok()?))),
            v => key_of(v, 0),
        }
    }

    /// Encode one record; the bytes are valid until the next call.
    /// [`Self::record`], its bytes handed out with their buffer, to be given back with
    /// [`Self::reuse`] (so that a builder can write them while it holds this encoder, with no
    /// second encoder made to stand in for it meanwhile).
    pub fn take_record(&mut self, v: &Value) -> Result<Vec<u8>, ArchiveError> {
        self.record(v)?;
        Ok(std::mem::take(&mut self.out))
    }

    /// Give back the buffer [`Self::take_record`] handed out: the next record reuses it.
    pub fn reuse(&mut self, out: Vec<u8>) {
        self.out = out;
    }

    pub fn record(&mut self, v: &Value) -> Result<&[u8], ArchiveError> {
        self.out.clear();
        if self.out.capacity() == 0 {
            // A fresh encoder (one per small object put): room for a usual record at once,
            // not grown from 8 bytes by three reallocations.
            self.out.reserve(256);
        }
        let mut queue = VecDeque::new();
        self.tagged(v, &mut queue)?;
        while let Some(p) = queue.pop_front() {
            let here = self.out.len();
            let dist = u32::try_from(here - p.at).map_err(|_| too_big())?;
            self.out[p.at..p.at + REF].copy_from_slice(&dist.to_le_bytes());
            match p.job {
                Job::Tagged(v) => self.tagged(v, &mut queue)?,
                Job::Key(Value::Sym(id)) => {
                    self.symbol(*id)?;
                    self.out.push(T_SYM);
                    put_varint(&mut self.out, *id as u64);
                }
                Job::Key(Value::Str(s)) => match self.intern(s) {
                    Some(id) => {
                        self.out.push(T_SYM);
                        put_varint(&mut self.out, id as u64);
                    }
                    None => put_blob(&mut self.out, T_STR, s.as_bytes()),
                },
                Job::Key(v) => self.tagged(v, &mut queue)?,
                Job::Blob(b) => {
                    put_varint(&mut self.out, b.len() as u64);
                    self.out.extend_from_slice(b);
                }
            }
        }
        if self.out.len() > u32::MAX as usize {
            return Err(too_big());
        }
        Ok(&self.out)
    }

    fn placeholder<'v>(&mut self, job: Job<'v>, queue: &mut VecDeque<Pending<'v>>) {
        queue.push_back(Pending {
            at: self.out.len(),
            job,
        });
        self.out.extend_from_slice(&[0; REF]);
    }

    fn tagged<'v>(
        &mut self,
        v: &'v Value,
        queue: &mut VecDeque<Pending<'v>>,
    ) -> Result<(), ArchiveError> {
        let o = &mut self.out;
        match v {
            Value::None => o.push(T_NONE),
            Value::Bool(b) => o.push(if *b { T_TRUE } else { T_FALSE }),
            Value::Int(i) => {
                let e = Elem::int_for(*i);
                o.push(match e {
                    Elem::I8 => T_I8,
                    Elem::I16 => T_I16,
                    Elem::I32 => T_I32,
                    _ => T_I64,
                });
                put_int(o, e, *i);
            }
            Value::BigInt(b) => put_blob(o, T_BIGINT, b),
            Value::Float(f) => {
                o.push(T_F64);
                o.extend_from_slice(&f.to_le_bytes());
            }
            Value::Complex([re, im]) => {
                o.push(T_COMPLEX);
                o.extend_from_slice(&re.to_le_bytes());
                o.extend_from_slice(&im.to_le_bytes());
            }
            Value::Str(s) => put_blob(o, T_STR, s.as_bytes()),
            Value::Sym(id) => put_blob(o, T_STR, symbol_in(&self.symbol_list, *id)?.as_bytes()),
            Value::Bytes(b) => put_blob(o, T_BYTES, b),
            Value::BytesExt(e) => {
                o.push(T_BYTES_EXT);
                for f in [e.offset, e.len, e.checksum] {
                    o.extend_from_slice(&f.to_le_bytes());
                }
            }
            Value::Array(m) => {
                let ts = m.typestr.as_bytes();
                if ts.len() > 255 || m.shape.len() > 255 {
                    return Err(ArchiveError::Invalid("array metadata too long".into()));
                }
                o.push(T_ARRAY);
                o.push(ts.len() as u8);
                o.extend_from_slice(ts);
                o.push(m.shape.len() as u8);
                for d in &m.shape {
                    o.extend_from_slice(&d.to_le_bytes());
                }
                for f in [m.data.offset, m.data.len, m.data.checksum] {
                    o.extend_from_slice(&f.to_le_bytes());
                }
            }
            Value::List(items) => self.seq(items, false, queue)?,
            Value::Tuple(items) => self.seq(items, true, queue)?,
            Value::Dict(pairs) => self.dict(pairs, queue)?,
        }
        Ok(())
    }

    fn seq<'v>(
        &mut self,
        items: &'v [Value],
        tuple: bool,
        queue: &mut VecDeque<Pending<'v>>,
    ) -> Result<(), ArchiveError> {
        if let Some(elem) = packable(items) {
            self.out
                .push(if tuple { T_TUPLE_PACKED } else { T_LIST_PACKED });
            self.out.push(elem as u8);
            put_varint(&mut self.out, items.len() as u64);
            for v in items {
                put_scalar(&mut self.out, elem, v);
            }
            return Ok(());
        }
        if let Some(id) = self.struct_shape(items) {
            self.out
                .push(if tuple { T_TUPLE_STRUCT } else { T_LIST_STRUCT });
            put_varint(&mut self.out, id as u64);
            put_varint(&mut self.out, items.len() as u64);
            for v in items {
                let Value::Dict(pairs) = v else {
                    unreachable!("struct_shape checked")
                };
                self.slots(id, pairs, queue);
            }
            return Ok(());
        }
        self.out.push(if tuple { T_TUPLE } else { T_LIST });
        put_varint(&mut self.out, items.len() as u64);
        for v in items {
            self.placeholder(Job::Tagged(v), queue);
        }
        Ok(())
    }

    fn dict<'v>(
        &mut self,
        pairs: &'v [(Value, Value)],
        queue: &mut VecDeque<Pending<'v>>,
    ) -> Result<(), ArchiveError> {
        if self.key_syms(pairs) {
            self.encs.clear();
            self.encs.extend(pairs.iter().map(|(_, v)| natural(v)));
            if let Some(id) = self.shape_for() {
                self.out.push(T_DICT_SHAPED);
                put_varint(&mut self.out, id as u64);
                self.slots(id, pairs, queue);
                return Ok(());
            }
        }
        // The general layout: any keys, any number of them.
        self.out.push(T_DICT);
        put_varint(&mut self.out, pairs.len() as u64);
        for (k, v) in pairs {
            self.placeholder(Job::Key(k), queue);
            self.placeholder(Job::Tagged(v), queue);
        }
        if dict_has_index(pairs.len()) {
            let hashes = pairs
                .iter()
                .map(|(k, _)| self.key_of(k).map(|k| k.stable_hash()))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| {
                    ArchiveError::Invalid("a dict key of a type that cannot be a key".into())
                })?;
            for slot in table::record_index(&hashes) {
                self.out.extend_from_slice(&slot.to_le_bytes());
            }
        }
        Ok(())
    }

    /// Whether the dict's keys can make a shape; if so, their symbol ids are in `self.keys`.
    fn key_syms(&mut self, pairs: &[(Value, Value)]) -> bool {
        if pairs.is_empty() || pairs.len() > MAX_SHAPE_FIELDS {
            return false;
        }
        self.keys.clear();
        for (k, _) in pairs {
            let id = match k {
                Value::Sym(id) if (*id as usize) < self.symbol_list.len() => *id,
                Value::Str(s) => match self.intern(s) {
                    Some(id) => id,
                    None => return false,
                },
                _ => return false,
            };
            self.keys.push(id);
        }
        true
    }

    /// The shape for `self.keys` and the natural encodings `self.encs`: the current shape of
    /// that key set if it holds them, else a wider version. `None` when the table is full.
    fn shape_for(&mut self) -> Option<u32> {
        if let Some(&id) = self.current.get(&self.keys[..]) {
            let cur = &self.shapes[id as usize];
            let mut same = true;
            for (e, c) in self.encs.iter_mut().zip(cur.encs.iter()) {
                *e = c.join(*e);
                same &= *e == *c;
            }
            if same {
                return Some(id);
            }
        }
        if self.shapes.len() >= MAX_SHAPES {
            return None;
        }
        let id = self.shapes.len() as u32;
        let keys: Box<[u32]> = self.keys.as_slice().into();
        self.shapes
            .push(Shape::new(keys.clone(), self.encs.as_slice().into()));
        self.current.insert(keys, id);
        Some(id)
    }

    /// A shape all of `items` can be written with, if they are dicts of one key set.
    fn struct_shape(&mut self, items: &[Value]) -> Option<u32> {
        let Some(Value::Dict(first)) = items.first() else {
            return None;
        };
        if !self.key_syms(first) {
            return None;
        }
        self.encs.clear();
        self.encs.extend(first.iter().map(|(_, v)| natural(v)));
        for v in &items[1..] {
            let Value::Dict(pairs) = v else { return None };
            if pairs.len() != first.len() {
                return None;
            }
            for (i, (k, v)) in pairs.iter().enumerate() {
                let same = match k {
                    Value::Sym(id) => *id == self.keys[i],
                    Value::Str(s) => self.symbol_list[self.keys[i] as usize].as_ref() == s.as_str(),
                    _ => false,
                };
                if !same {
                    return None;
                }
                self.encs[i] = self.encs[i].join(natural(v));
            }
        }
        // Rows of no bytes (every field always None, say) are written as a list of
        // references instead: a reader takes a row count larger than the bytes left in its
        // record for a crafted one (docs/format.md, "Checking").
        self.shape_for()
            .filter(|&id| self.shapes[id as usize].size > 0)
    }

    /// The slots of a dict of shape `id` (its values fit the shape's encodings).
    fn slots<'v>(
        &mut self,
        id: u32,
        pairs: &'v [(Value, Value)],
        queue: &mut VecDeque<Pending<'v>>,
    ) {
        for (i, (_, v)) in pairs.iter().enumerate() {
            let enc = self.shapes[id as usize].encs[i];
            let o = &mut self.out;
            match (enc, v) {
                (Enc::None, _) => {}
                (Enc::Bool, Value::Bool(b)) => o.push(*b as u8),
                (Enc::Int(e), Value::Int(x)) => put_int(o, e, *x),
                (Enc::F64, Value::Float(f)) => o.extend_from_slice(&f.to_le_bytes()),
                (Enc::Str, Value::Str(s)) => self.placeholder(Job::Blob(s.as_bytes()), queue),
                (Enc::Bytes, Value::Bytes(b)) => self.placeholder(Job::Blob(b), queue),
                (Enc::Pack { elem, .. }, Value::List(items) | Value::Tuple(items)) => {
                    for x in items {
                        put_scalar(o, elem, x);
                    }
                }
                _ => self.placeholder(Job::Tagged(v), queue),
            }
        }
    }
}

/// The narrowest field encoding of a value.
fn natural(v: &Value) -> Enc {
    match v {
        Value::None => Enc::None,
        Value::Bool(_) => Enc::Bool,
        Value::Int(i) => Enc::Int(Elem::int_for(*i)),
        Value::Float(_) => Enc::F64,
        Value::Str(_) => Enc::Str,
        Value::Bytes(_) => Enc::Bytes,
        Value::List(items) | Value::Tuple(items)
            if !items.is_empty() && items.len() <= MAX_FIELD_PACK =>
        {
            match packable(items) {
                Some(elem) => Enc::Pack {
                    elem,
                    count: items.len() as u8,
                    tuple: matches!(v, Value::Tuple(_)),
                },
                None => Enc::Ref,
            }
        }
        _ => Enc::Ref,
    }
}

/// The element type a non-empty list of all-bool, all-int or all-float values packs as.
fn packable(items: &[Value]) -> Option<Elem> {
    let mut elem = match items.first()? {
        Value::Bool(_) => Elem::Bool,
        Value::Int(_) => Elem::I8,
        Value::Float(_) => Elem::F64,
        _ => return None,
    };
    for v in items {
        match (elem, v) {
            (Elem::Bool, Value::Bool(_)) | (Elem::F64, Value::Float(_)) => {}
            (e, Value::Int(i)) if e.is_int() => {
                let need = Elem::int_for(*i);
                if need.size() > e.size() {
                    elem = need;
                }
            }
            _ => return None,
        }
    }
    Some(elem)
}

/// A tag, then a varint length and the bytes.
fn put_blob(o: &mut Vec<u8>, tag: u8, b: &[u8]) {
    o.push(tag);
    put_varint(o, b.len() as u64);
    o.extend_from_slice(b);
}

fn put_int(o: &mut Vec<u8>, e: Elem, i: i64) {
    o.extend_from_slice(&i.to_le_bytes()[..e.size()]);
}

fn put_scalar(o: &mut Vec<u8>, e: Elem, v: &Value) {
    match v {
        Value::Bool(b) => o.push(*b as u8),
        Value::Int(i) => put_int(o, e, *i),
        Value::Float(f) => o.extend_from_slice(&f.to_le_bytes()),
        _ => unreachable!("packable checked"),
    }
}

/// A stored dict key as a `Key` (None for a value of a type that cannot be a key).
pub fn key_of(v: &Value, depth: usize) -> Option<Key<'_>> {
    use std::borrow::Cow::Borrowed;
    Some(match v {
        Value::None => Key::None,
        Value::Bool(b) => Key::Bool(*b),
        Value::Int(i) => Key::Int(*i),
        Value::BigInt(b) => Key::BigInt(Borrowed(b)),
        Value::Float(f) => Key::Float(*f),
        Value::Str(s) => Key::Str(Borrowed(s)),
        Value::Bytes(b) => Key::Bytes(Borrowed(b)),
        Value::Tuple(items) if depth < super::value::MAX_KEY_DEPTH => Key::Tuple(
            items
                .iter()
                .map(|v| key_of(v, depth + 1))
                .collect::<Option<_>>()?,
        ),
        _ => return None,
    })
}
