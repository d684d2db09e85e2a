//! Validating reader over an archive's bytes (a read-only mapping).
//!
//! Checking is split so that no byte is trusted before it is checked, yet a reader pays
//! only for what it touches:
//! - at open: the header, region bounds and one checksum over the metadata (index,
//!   symbols, keys, table) — O(records), not O(bytes);
//! - at the first access of a record in this process: the record span's checksum and
//!   rkyv's structural validation (bytecheck) of that record — then a bit is set and later
//!   accesses are free.

use std::sync::atomic::{AtomicU64, Ordering};

use rkyv::rancor;
use rkyv::validation::{archive::ArchiveValidator, Validator};
use xxhash_rust::xxh3::xxh3_64;

use super::header::{Header, Kind, INDEX_ENTRY, PAYLOAD_ALIGN, SPAN_ALIGN};
use super::key::{decode_key, Key};
use super::value::{
    typestr_itemsize, ArchivedArrayMeta, ArchivedExtent, ArchivedValue, MAX_SUBTREE_DEPTH,
};
use super::{table, u32_at, u64_at, ArchiveError};

/// A validated position of an archived value: only the [`Reader`] makes these, from values
/// it has validated, so turning one back into a reference is sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    rec: u32,
    pos: u64,
}

impl Node {
    /// The record this node belongs to.
    pub fn record(self) -> u32 {
        self.rec
    }
    /// Absolute byte position in the archive.
    pub fn pos(self) -> u64 {
        self.pos
    }
}

/// Where array data lives and how to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayView<'a> {
    pub typestr: &'a str,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the archive (64-byte aligned).
    pub offset: usize,
    pub nbytes: usize,
}

pub struct Reader<B> {
    backing: B,
    header: Header,
    /// One bit per record: span checksum and structure checked in this process.
    validated: Vec<AtomicU64>,
    /// One bit per record: its in-record dict indexes checked (`confirm_miss`).
    indexes_checked: Vec<AtomicU64>,
    /// Absolute [start, end) of each symbol's UTF-8 bytes.
    symbols: Vec<(usize, usize)>,
}

fn corrupt<T>(msg: impl Into<String>) -> Result<T, ArchiveError> {
    Err(ArchiveError::Corrupt(msg.into()))
}

/// Most dimensions an array may have (numpy's limit since numpy 2).
pub const MAX_NDIM: usize = 64;

/// How far before a record's end a dict lookup prefetches (its root value and the bytes of
/// a str that ends there).
const PREFETCH_BACK: usize = 1024;

/// Start loading the cache line of `bytes[at]`; out-of-range positions are ignored.
#[inline(always)]
fn prefetch(bytes: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < bytes.len() {
        let p = bytes[at..].as_ptr();
        // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is in the
        // target's baseline). A prefetch is a hint: it never faults and has no effect on
        // program state, and `p` points inside `bytes` anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, at);
}

impl<B: AsRef<[u8]>> Reader<B> {
    /// Check the header and metadata; records are checked lazily on first access.
    pub fn open(backing: B) -> Result<Self, ArchiveError> {
        let bytes = backing.as_ref();
        let header = Header::parse(bytes)?;
        if header.kind == Kind::Dict {
            let slot = table::SLOT as u64;
            if header.table_len % slot != 0
                || header.table_len / slot != table::capacity(header.count)
                || header.keys_len < (header.count + 1) * 8
            {
                return corrupt("dict table/keys region malformed");
            }
        }
        let symbols = parse_symbols(bytes, &header)?;
        let words = header.count.div_ceil(64) as usize;
        Ok(Reader {
            validated: (0..words).map(|_| AtomicU64::new(0)).collect(),
            indexes_checked: (0..words).map(|_| AtomicU64::new(0)).collect(),
            backing,
            header,
            symbols,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn kind(&self) -> Kind {
        self.header.kind
    }

    pub fn len(&self) -> u64 {
        self.header.count
    }

    pub fn bytes(&self) -> &[u8] {
        self.backing.as_ref()
    }

    pub fn backing(&self) -> &B {
        &self.backing
    }

    fn span(&self, rec: u64) -> (usize, usize, u64) {
        let at = self.header.index_off as usize + rec as usize * INDEX_ENTRY;
        let b = self.bytes();
        (
            u64_at(b, at) as usize,
            u64_at(b, at + 8) as usize,
            u64_at(b, at + 16),
        )
    }

    fn check_span(&self, rec: u64) -> Result<(usize, usize), ArchiveError> {
        let (start, end, hash) = self.span(rec);
        let min = std::mem::size_of::<ArchivedValue>();
        // Checked: both ends come from the file and may be anything up to 2^64 - 1.
        if start % SPAN_ALIGN as usize != 0
            || start < super::header::HEADER_LEN
            || end > self.header.index_off as usize
            || start.checked_add(min).is_none_or(|m| end < m)
        {
            return corrupt(format!("record {rec}: span {start}..{end} out of bounds"));
        }
        if xxh3_64(&self.bytes()[start..end]) != hash {
            return corrupt(format!(
                "record {rec}: checksum mismatch (the data was modified)"
            ));
        }
        Ok((start, end))
    }

    /// Run the full checks on a record now (normally done on first access).
    pub fn validate_record(&self, rec: u64) -> Result<(), ArchiveError> {
        if rec >= self.header.count {
            return Err(ArchiveError::Invalid(format!("record {rec} out of range")));
        }
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        if self.validated[word].load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        let (start, end) = self.check_span(rec)?;
        let bytes = &self.bytes()[start..end];
        check_value(bytes, end - start - std::mem::size_of::<ArchivedValue>())
            .map_err(|e| ArchiveError::Corrupt(format!("record {rec}: invalid structure: {e}")))?;
        self.validated[word].fetch_or(bit, Ordering::AcqRel);
        Ok(())
    }

    /// A lookup in record `rec` missed in an indexed dict: make sure that is because the key
    /// is absent, not because a forged index hides it. The first miss in a record checks
    /// every indexed dict of the record (each entry must be found from its key's hash);
    /// later misses are free. `Corrupt` if an index does not find one of its entries.
    pub fn confirm_miss(&self, rec: u64) -> Result<(), ArchiveError> {
        self.validate_record(rec)?;
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        if self.indexes_checked[word].load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        let root = self.get(self.root(rec)?);
        let mut stack = vec![root];
        while let Some(v) = stack.pop() {
            match v {
                ArchivedValue::List(items) | ArchivedValue::Tuple(items) => {
                    stack.extend(items.iter().filter(|v| is_container(v)));
                }
                ArchivedValue::Dict(items) => {
                    stack.extend(items.iter().skip(1).step_by(2).filter(|v| is_container(v)));
                }
                ArchivedValue::IndexedDict(d) => {
                    let (items, index) = (d.items.as_slice(), d.index.as_slice());
                    stack.extend(items.iter().skip(1).step_by(2).filter(|v| is_container(v)));
                    for (e, k) in items.iter().step_by(2).enumerate() {
                        let hash = self.value_key(k)?.stable_hash();
                        if !index_finds(index, hash, e, items.len() / 2) {
                            return corrupt(format!(
                                "record {rec}: a dict's hash index does not find its entry {e}"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        self.indexes_checked[word].fetch_or(bit, Ordering::AcqRel);
        Ok(())
    }

    /// Check every record (O(archive size)). Readers never need this for safety.
    pub fn validate_all(&self) -> Result<(), ArchiveError> {
        (0..self.header.count).try_for_each(|r| self.validate_record(r))
    }

    /// The root value of record `rec` (validated on first access in this process).
    pub fn root(&self, rec: u64) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (_, end, _) = self.span(rec);
        Ok(Node {
            rec: rec as u32,
            pos: (end - std::mem::size_of::<ArchivedValue>()) as u64,
        })
    }

    /// Rebuild a node from an untrusted (record, position) pair, e.g. from a pickle:
    /// the record is validated, then the value at `pos` is validated as a subtree.
    pub fn node_checked(&self, rec: u64, pos: u64) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (start, end, _) = self.span(rec);
        let pos = pos as usize;
        if pos < start || pos >= end {
            return corrupt(format!("position {pos} is not inside record {rec}"));
        }
        check_value(&self.bytes()[start..end], pos - start)
            .map_err(|e| ArchiveError::Corrupt(format!("record {rec}: no value at {pos}: {e}")))?;
        Ok(Node {
            rec: rec as u32,
            pos: pos as u64,
        })
    }

    /// The archived value behind a node.
    pub fn get(&self, node: Node) -> &ArchivedValue {
        let bytes = self.bytes();
        let pos = node.pos as usize;
        assert!(pos + std::mem::size_of::<ArchivedValue>() <= bytes.len());
        // SAFETY: `Node`s are only created by this reader (private fields) for positions
        // of values that it validated: a record root after `validate_record` (checksum +
        // bytecheck of the whole record), a value reached from such a validated value
        // (`child`, which checks the reference points into this archive), or a subtree
        // validated by `access_pos` (`node_checked`). The bytes are immutable for the
        // reader's lifetime (sealed archive, read-only mapping), so the validation holds.
        unsafe { &*(bytes.as_ptr().add(pos) as *const ArchivedValue) }
    }

    /// A node for `value`, a value reached from `parent`'s (validated) tree.
    pub fn child(&self, parent: Node, value: &ArchivedValue) -> Node {
        let base = self.bytes().as_ptr() as usize;
        let addr = value as *const ArchivedValue as usize;
        assert!(
            addr >= base && addr - base < self.bytes().len(),
            "value does not belong to this archive"
        );
        Node {
            rec: parent.rec,
            pos: (addr - base) as u64,
        }
    }

    /// Number of interned symbols.
    pub fn symbol_count(&self) -> usize {
        self.symbols.len()
    }

    /// An interned string.
    pub fn symbol(&self, id: u32) -> Result<&str, ArchiveError> {
        let &(s, e) = self
            .symbols
            .get(id as usize)
            .ok_or_else(|| ArchiveError::Corrupt(format!("symbol {id} out of range")))?;
        // SAFETY: every symbol's bytes were checked to be UTF-8 in `parse_symbols` when the
        // reader opened, and the archive bytes never change afterwards.
        Ok(unsafe { std::str::from_utf8_unchecked(&self.bytes()[s..e]) })
    }

    /// Dict archives: the key of entry `i`.
    pub fn key(&self, i: u64) -> Result<Key<'_>, ArchiveError> {
        if self.header.kind != Kind::Dict || i >= self.header.count {
            return Err(ArchiveError::Invalid(format!("no key {i}")));
        }
        let (k, rest) = decode_key(self.key_bytes(i)?)?;
        if !rest.is_empty() {
            return corrupt(format!("key {i}: trailing bytes"));
        }
        Ok(k)
    }

    /// Dict archives: the entry number of `key`, if present. Bounded probing: a corrupted
    /// table can give a wrong answer or an error, never a hang.
    pub fn lookup(&self, key: &Key<'_>) -> Result<Option<u64>, ArchiveError> {
        if self.header.kind != Kind::Dict {
            return Ok(None);
        }
        if let Key::Str(s) = key {
            // Hot path (doc_id -> text): a str can only equal a stored str, whose canonical
            // encoding is unique, so compare encoded bytes; no decoding, no UTF-8 check.
            let b = self.bytes();
            let keys_end = (self.header.keys_off + self.header.keys_len) as usize;
            return self.probe(super::key::hash_str(s), |e, at| {
                // The encoding is self-delimiting (tag, u32 length, bytes), so the key's start
                // is enough; from the slot when it has it, else from the keys' offsets.
                let k = match at {
                    Some(at) if at < keys_end => &b[at..keys_end],
                    _ => self.key_bytes(e)?,
                };
                Ok(k.len() >= s.len() + 5
                    && k[0] == super::key::T_STR
                    && k[1..5] == (s.len() as u32).to_le_bytes()
                    && &k[5..5 + s.len()] == s.as_bytes())
            });
        }
        self.probe(key.stable_hash(), |e, _| Ok(self.key(e)?.key_eq(key)))
    }

    /// The encoded bytes of key `i` (bounds-checked).
    fn key_bytes(&self, i: u64) -> Result<&[u8], ArchiveError> {
        let b = self.bytes();
        let ko = self.header.keys_off as usize;
        let blob = ko + (self.header.count as usize + 1) * 8;
        let end = ko + self.header.keys_len as usize;
        let s = u64_at(b, ko + i as usize * 8) as usize;
        let e = u64_at(b, ko + (i as usize + 1) * 8) as usize;
        if s > e || blob.checked_add(e).is_none_or(|x| x > end) {
            return corrupt(format!("key {i}: offsets out of bounds"));
        }
        Ok(&b[blob + s..blob + e])
    }

    fn probe(
        &self,
        h: u64,
        mut matches: impl FnMut(u64, Option<usize>) -> Result<bool, ArchiveError>,
    ) -> Result<Option<u64>, ArchiveError> {
        let b = self.bytes();
        let cap = self.header.table_len / table::SLOT as u64; // checked at open: >= 8
        let to = self.header.table_off as usize;
        let blob = self.header.keys_off as usize + (self.header.count as usize + 1) * 8;
        let mut i = table::home(h, cap);
        for _ in 0..cap {
            let at = to + i as usize * table::SLOT;
            let slot = table::Slot::read(&b[at..at + table::SLOT]);
            let Some(e) = slot.entry() else {
                return Ok(None);
            };
            if slot.tag == h as u32 {
                if e >= self.header.count {
                    return corrupt(format!(
                        "dict table slot points at entry {e} of {}",
                        self.header.count
                    ));
                }
                // Hints (docs/format.md, "The dict table"): start loading the key and the end
                // of the record (its root value and, for a str, its bytes) now, so that the
                // misses on the key, the index and the record overlap instead of following
                // one another. The record hint is only prefetched; the key hint also tells
                // `matches` where the key is (bounds-checked there, like the offsets).
                let key_at = slot.key_hint().map(|k| blob.saturating_add(k));
                if let Some(at) = key_at {
                    prefetch(b, at);
                }
                if let Some(end) = slot.end_hint() {
                    // From the end down: the root value is needed first.
                    for line in (end.saturating_sub(PREFETCH_BACK - 64)..=end)
                        .rev()
                        .step_by(64)
                    {
                        prefetch(b, line);
                    }
                }
                if matches(e, key_at)? {
                    return Ok(Some(e));
                }
            }
            i = table::next(i as usize, cap as usize) as u64;
        }
        Ok(None)
    }

    /// A key stored inside a record as a `Key`.
    pub fn value_key<'s>(&'s self, v: &'s ArchivedValue) -> Result<Key<'s>, ArchiveError> {
        self.value_key_depth(v, 0)
    }

    fn value_key_depth<'s>(
        &'s self,
        v: &'s ArchivedValue,
        depth: usize,
    ) -> Result<Key<'s>, ArchiveError> {
        use std::borrow::Cow::Borrowed;
        Ok(match v {
            ArchivedValue::None => Key::None,
            ArchivedValue::Bool(b) => Key::Bool(*b),
            ArchivedValue::Int(i) => Key::Int(i.to_native()),
            ArchivedValue::BigInt(b) if !super::key::bigint_fits_i64(b.as_slice()) => {
                Key::BigInt(Borrowed(b.as_slice()))
            }
            ArchivedValue::Float(f) => Key::Float(f.to_native()),
            ArchivedValue::Str(s) => Key::Str(Borrowed(s.as_str())),
            ArchivedValue::Sym(id) => Key::Str(Borrowed(self.symbol(id.to_native())?)),
            ArchivedValue::Bytes(b) => Key::Bytes(Borrowed(b.as_slice())),
            ArchivedValue::Tuple(items) if depth < 64 => Key::Tuple(
                items
                    .iter()
                    .map(|it| self.value_key_depth(it, depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
            _ => return corrupt("a dict key of a type that cannot be a key"),
        })
    }

    /// Look `key` up in an archived dict (`items` interleaved `k0, v0, k1, v1, ...`, `index`
    /// empty for small dicts); returns the entry number. Bounded: never loops forever.
    pub fn dict_find(
        &self,
        items: &[ArchivedValue],
        index: &[rkyv::Archived<u32>],
        key: &Key<'_>,
    ) -> Result<Option<usize>, ArchiveError> {
        self.dict_probe(items, index, key.stable_hash(), |k| {
            Ok(self.value_key(k)?.key_eq(key))
        })
    }

    /// `dict_find` for a str key without building a `Key` (the hot path of `view['field']`).
    pub fn dict_find_str(
        &self,
        items: &[ArchivedValue],
        index: &[rkyv::Archived<u32>],
        key: &str,
    ) -> Result<Option<usize>, ArchiveError> {
        let hash = if index.is_empty() {
            0
        } else {
            super::key::hash_str(key)
        };
        self.dict_probe(items, index, hash, |k| {
            Ok(match k {
                ArchivedValue::Sym(id) => self.symbol(id.to_native())? == key,
                ArchivedValue::Str(s) => s.as_str() == key,
                _ => false,
            })
        })
    }

    fn dict_probe(
        &self,
        items: &[ArchivedValue],
        index: &[rkyv::Archived<u32>],
        hash: u64,
        mut matches: impl FnMut(&ArchivedValue) -> Result<bool, ArchiveError>,
    ) -> Result<Option<usize>, ArchiveError> {
        if items.len() % 2 != 0 {
            // A key without its value: finding it would index past the items.
            return corrupt("a dict with a key but no value");
        }
        if index.is_empty() {
            for (i, k) in items.iter().step_by(2).enumerate() {
                if matches(k)? {
                    return Ok(Some(i));
                }
            }
            return Ok(None);
        }
        let cap = index.len();
        if cap != table::record_index_capacity(items.len() / 2) {
            return corrupt("dict index size does not match its entries");
        }
        let mut i = table::home(hash, cap as u64) as usize;
        for _ in 0..cap {
            let e = index[i].to_native() as usize;
            if e == 0 {
                return Ok(None);
            }
            let k = items
                .get(2 * (e - 1))
                .ok_or_else(|| ArchiveError::Corrupt("dict index out of range".into()))?;
            if matches(k)? {
                return Ok(Some(e - 1));
            }
            i = table::next(i, cap);
        }
        Ok(None)
    }

    /// Absolute [start, end) of a record's span.
    fn span_range(&self, node: Node) -> (usize, usize) {
        let (s, e, _) = self.span(node.rec as u64);
        (s, e)
    }

    fn extent(&self, node: Node, ext: &ArchivedExtent) -> Result<(usize, usize), ArchiveError> {
        let (s, e) = self.span_range(node);
        let off = ext.offset.to_native();
        let len = ext.len.to_native();
        match off.checked_add(len) {
            Some(end) if end <= (e - s) as u64 => Ok((s + off as usize, len as usize)),
            _ => corrupt(format!("record {}: payload out of bounds", node.rec)),
        }
    }

    /// Out-of-line bytes of a `BytesExt` value in `node`'s record.
    pub fn payload(&self, node: Node, ext: &ArchivedExtent) -> Result<&[u8], ArchiveError> {
        let (off, len) = self.extent(node, ext)?;
        Ok(&self.bytes()[off..off + len])
    }

    /// Check an array's metadata against its data and return where it lives.
    pub fn array<'s>(
        &'s self,
        node: Node,
        meta: &'s ArchivedArrayMeta,
    ) -> Result<ArrayView<'s>, ArchiveError> {
        let typestr = meta.typestr.as_str();
        let Some(itemsize) = typestr_itemsize(typestr) else {
            return corrupt(format!("array with unsupported dtype {typestr:?}"));
        };
        if meta.shape.len() > MAX_NDIM {
            return corrupt(format!(
                "record {}: array with {} dimensions (at most {MAX_NDIM})",
                node.rec,
                meta.shape.len()
            ));
        }
        let shape: Vec<usize> = meta.shape.iter().map(|d| d.to_native() as usize).collect();
        // numpy's own rule (it skips zero dimensions): the product of the other dimensions
        // times the item size must fit in an isize, else it refuses the array. An empty
        // array of shape (0, 2**62) holds no data but is still no array numpy can make.
        let too_big =
            || ArchiveError::Corrupt(format!("record {}: array shape overflows", node.rec));
        let span = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or_else(too_big)?;
        let n = if shape.contains(&0) { 0 } else { span };
        let (offset, nbytes) = self.extent(node, &meta.data)?;
        if n != nbytes || offset % PAYLOAD_ALIGN as usize != 0 {
            return corrupt(format!("record {}: array metadata inconsistent", node.rec));
        }
        Ok(ArrayView {
            typestr,
            shape,
            offset,
            nbytes,
        })
    }
}

/// Whether probing `index` (entry + 1 per slot, 0 = empty) from `hash` reaches `entry`.
fn index_finds(index: &[rkyv::Archived<u32>], hash: u64, entry: usize, n: usize) -> bool {
    let cap = index.len();
    if cap == 0 {
        return false;
    }
    // The same probe sequence as `dict_probe` (and the builder's `table::record_index`).
    let mut i = table::home(hash, cap as u64) as usize;
    for _ in 0..cap {
        let slot = index[i].to_native() as usize;
        if slot == 0 || slot > n {
            return false;
        }
        if slot == entry + 1 {
            return true;
        }
        i = table::next(i, cap);
    }
    false
}

fn is_container(v: &ArchivedValue) -> bool {
    matches!(
        v,
        ArchivedValue::List(_)
            | ArchivedValue::Tuple(_)
            | ArchivedValue::Dict(_)
            | ArchivedValue::IndexedDict(_)
    )
}

/// rkyv's structural validation of the `Value` at `pos` in a record's bytes, with the
/// format's depth limit: rkyv's check recurses once per pointer it follows, so without a
/// limit a crafted record nested tens of thousands deep overflows the stack. With one,
/// validation stops at [`MAX_SUBTREE_DEPTH`] levels and the record is corrupt; every later
/// recursive reader (decode, compare, repr) only ever sees validated, bounded values.
/// Low validator: `Value` holds no shared pointers.
fn check_value(bytes: &[u8], pos: usize) -> Result<(), rancor::BoxedError> {
    let depth = std::num::NonZeroUsize::new(MAX_SUBTREE_DEPTH);
    let mut context = Validator::new(ArchiveValidator::with_max_depth(bytes, depth), ());
    rkyv::api::check_pos_with_context::<ArchivedValue, _, rancor::BoxedError>(
        bytes,
        pos,
        &mut context,
    )
}

fn parse_symbols(bytes: &[u8], h: &Header) -> Result<Vec<(usize, usize)>, ArchiveError> {
    let so = h.symbols_off as usize;
    let sl = h.symbols_len as usize;
    if sl < 8 {
        return corrupt("symbol table truncated");
    }
    let n = u32_at(bytes, so) as usize;
    let offs = so + 4;
    let blob = offs + (n + 1) * 4;
    if n > super::builder::MAX_SYMBOLS || blob > so + sl {
        return corrupt("symbol table malformed");
    }
    let mut out = Vec::with_capacity(n);
    let mut prev = u32_at(bytes, offs) as usize;
    for i in 0..n {
        let next = u32_at(bytes, offs + (i + 1) * 4) as usize;
        if next < prev || blob + next > so + sl {
            return corrupt("symbol table offsets malformed");
        }
        let s = &bytes[blob + prev..blob + next];
        if std::str::from_utf8(s).is_err() {
            return corrupt(format!("symbol {i} is not UTF-8"));
        }
        out.push((blob + prev, blob + next));
        prev = next;
    }
    Ok(out)
}
