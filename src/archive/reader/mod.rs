//! Reader over an archive's bytes (a read-only mapping), reading records in place.
//!
//! Every read is checked: positions, lengths and references that come from the bytes are
//! bounds-checked against the records region before use, so no byte sequence can make a
//! read leave the mapping, panic or loop. On top of that, integrity is checked lazily:
//! - at open: the header, region bounds, one checksum over the metadata (index, blocks,
//!   symbols, shapes, keys, table), and the symbols and shapes themselves: O(metadata);
//! - at the first access of a record in this process: its *block* (up to
//!   [`BLOCK_RECORDS`](super::builder::BLOCK_RECORDS) records) is checksummed and each of
//!   its records walked once as a tree (every reference points forward, no two at the same
//!   value, depth within the format's limit), so later reads need no budget against
//!   shared or cyclic structure. Then a bit per record is set and later accesses are free;
//! - out-of-line payloads (array data, big bytes) have their own checksum, checked by
//!   [`Reader::validate_all`] and never on the read path: any bit pattern of a numeric array is a
//!   valid array, so reading one needs no hash (docs/format.md, "Integrity").

mod access;
mod check;
mod lookup;

use check::{parse_blocks, parse_shapes, parse_symbols};

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use xxhash_rust::xxh3::Xxh3Default;

use crate::archive::hash::xxh3_64;

use crate::archive::builder::BLOCK_RECORDS;
use crate::archive::format::*;
use crate::archive::header::{record_span, Header, Kind, BLOCK_ENTRY, HEADER_LEN, PAYLOAD_ALIGN};
use crate::archive::key::{decode_key, Key};
use crate::archive::value::{Extent, TypeStr, MAX_DEPTH, MAX_KEY_DEPTH};
use crate::archive::{table, u32_at, u64_at, ArchiveError};

/// How a node's bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// A tagged value starts at the node's position.
    Tagged,
    /// The slots of a dict of this shape start at the node's position.
    Struct(u32),
    /// A packed field: `count` elements of `elem` start at the node's position.
    Pack { elem: Elem, count: u8, tuple: bool },
}

/// A position of a container (or any value) in a record. Any `Node` is safe to read: reads
/// through it are bounds-checked, so one rebuilt from a pickle can at worst be `Corrupt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    rec: u32,
    pub(crate) form: Form,
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
    #[cfg(test)]
    pub fn form(self) -> Form {
        self.form
    }
    /// The node as its three parts, to be passed in registers (a `Node` is passed through
    /// memory) and made again with [`Self::from_parts`].
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))] // the stable-ABI wheel keeps pyo3's slots
    pub fn into_parts(self) -> (u32, Form, u64) {
        (self.rec, self.form, self.pos)
    }
    /// The node [`Self::into_parts`] took apart.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub fn from_parts((rec, form, pos): (u32, Form, u64)) -> Self {
        Node { rec, form, pos }
    }
    /// The form as two integers, for pickles (`Reader::node_from`).
    pub fn form_code(self) -> (u8, u32) {
        match self.form {
            Form::Tagged => (0, 0),
            Form::Struct(s) => (1, s),
            Form::Pack { elem, count, tuple } => {
                (2, (elem as u32) << 16 | (count as u32) << 8 | tuple as u32)
            }
        }
    }
}

/// An out-of-line array: where its data lives and how to read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayAt {
    /// Position of the array's metadata (after its tag).
    pos: u64,
    rec: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayView {
    pub typestr: TypeStr,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the archive (64-byte aligned).
    pub offset: usize,
    pub nbytes: usize,
}

impl From<Scalar> for Item<'_> {
    fn from(s: Scalar) -> Self {
        match s {
            Scalar::Bool(b) => Item::Bool(b),
            Scalar::Int(i) => Item::Int(i),
            Scalar::Float(f) => Item::Float(f),
        }
    }
}

/// One value read from a record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Item<'a> {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside i64 (two's complement, little-endian).
    BigInt(&'a [u8]),
    Float(f64),
    Complex(f64, f64),
    /// UTF-8 as stored (checked when converted).
    Str(&'a [u8]),
    /// A str of the symbol table.
    Sym(u32),
    Bytes(&'a [u8]),
    BytesExt(Extent),
    Array(ArrayAt),
    List(Node),
    Tuple(Node),
    Dict(Node),
}

/// A shape as read from the metadata, with what the reader needs precomputed.
#[derive(Debug)]
pub struct ShapeInfo {
    pub shape: Shape,
    /// Field indexes whose slot holds a reference.
    refs: Box<[u16]>,
    /// Whether a field is packed numbers (a list one level below the dict).
    packs: bool,
}

pub struct Reader<B> {
    backing: B,
    header: Header,
    /// One bit per record: its block's checksum and its tree checked in this process.
    validated: Vec<AtomicU64>,
    /// One bit per record: the hash indexes of its general dicts checked (`confirm_miss`);
    /// made at the first miss (most stores never miss a lookup, and an object's store is
    /// opened for every small object a channel passes).
    indexes_checked: OnceLock<Box<[AtomicU64]>>,
    /// The block checked last in this process (`usize::MAX` before the first): a block
    /// checked right after the one before it is read in order, and the next one's bytes
    /// are worth loading ahead (`prefetch_next_block`).
    last_checked: AtomicUsize,
    /// First record of each block; empty when every record is a block of its own
    /// ([`Self::alone`]): block `b` is then record `b`, and a store of a million documents
    /// does not keep 8 MB of this table in every process that reads it.
    pub(crate) block_first: Vec<u64>,
    /// Absolute [start, end) of each symbol's UTF-8 bytes.
    symbols: Vec<(usize, usize)>,
    shapes: Vec<ShapeInfo>,
    /// End of the records region (= index_off): every record byte lies before it.
    rec_end: usize,
}

fn corrupt<T>(msg: impl Into<String>) -> Result<T, ArchiveError> {
    Err(ArchiveError::Corrupt(msg.into()))
}

/// A stored str's bytes as a `str`: `Corrupt` if they are not UTF-8 (the check of every
/// read of a str, in Rust; the Python layer's strict UTF-8 decoding refuses the same bytes).
#[inline]
pub fn stored_str(b: &[u8]) -> Result<&str, ArchiveError> {
    std::str::from_utf8(b)
        .map_err(|_| ArchiveError::Corrupt("a stored str is not valid UTF-8".into()))
}

#[cold]
#[inline(never)]
fn count_past_end<T>(n: u64, at: usize) -> Result<T, ArchiveError> {
    corrupt(format!("count {n} at {at} runs past the records"))
}

type Scratch = (Vec<(usize, usize)>, Vec<(usize, check::Depth, usize)>);

thread_local! {
    /// Reused by `validate_block` (spans of a block's records, the walk queue).
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

/// How many bytes of a record `root` asks the cache for ahead of reading them.
const ROOT_PREFETCH: usize = 512;
/// Bytes of the next block that a block's check asks for ahead (`prefetch_next_block`): a
/// block closes at 4 KiB of records, and a record of 512 bytes or more is alone, so this
/// covers every block of small records whole.
const NEXT_BLOCK_PREFETCH: usize = 4096 + 512;

/// Most dimensions an array may have (numpy's limit since numpy 2).
pub const MAX_NDIM: usize = 64;

/// How many bytes from a record's start a dict lookup prefetches.
const PREFETCH_AHEAD: usize = 1024;

/// Start loading the cache line of `bytes[at]`; out-of-range positions are ignored.
#[inline(always)]
pub fn prefetch(bytes: &[u8], at: usize) {
    prefetch_lines(bytes, at, at.saturating_add(1));
}

/// Start loading the cache lines of `bytes[start..end]` (`end` past the bytes is cut to
/// them): one bound for the whole range, so a line costs the prefetch and a compare.
#[inline(always)]
pub fn prefetch_lines(bytes: &[u8], start: usize, end: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = end.min(bytes.len());
        let base = bytes.as_ptr();
        let mut at = start;
        while at < end {
            // SAFETY: as in `prefetch`; `at < end <= bytes.len()`, so the address is inside
            // `bytes`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    base.add(at) as *const i8
                )
            };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, start, end);
}

impl<B: AsRef<[u8]>> Reader<B> {
    /// Check the header and metadata; records are checked lazily on first access.
    pub fn open(backing: B) -> Result<Self, ArchiveError> {
        let bytes = backing.as_ref();
        let header = Header::parse(bytes)?;
        if header.kind == Kind::Dict {
            let slot = table::SLOT as u64;
            if header.table_len() % slot != 0
                || header.table_len() / slot != table::capacity(header.count)
                || header.keys_len() < (header.count + 1) * 8
            {
                return corrupt("dict table/keys region malformed");
            }
        }
        let symbols = parse_symbols(bytes, &header)?;
        let shapes = parse_shapes(bytes, &header, &symbols)?;
        // Empty when every record is a block of its own (`parse_blocks`).
        let block_first = parse_blocks(bytes, &header)?;
        let words = header.count.div_ceil(64) as usize;
        Ok(Reader {
            validated: (0..words).map(|_| AtomicU64::new(0)).collect(),
            indexes_checked: OnceLock::new(),
            last_checked: AtomicUsize::new(usize::MAX),
            block_first,
            rec_end: header.index_off as usize,
            backing,
            header,
            symbols,
            shapes,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn kind(&self) -> Kind {
        self.header.kind
    }

    #[inline(always)]
    pub fn len(&self) -> u64 {
        self.header.count
    }

    pub fn bytes(&self) -> &[u8] {
        self.backing.as_ref()
    }

    pub fn backing(&self) -> &B {
        &self.backing
    }

    pub fn shapes(&self) -> &[ShapeInfo] {
        &self.shapes
    }

    // --- checked access to the records region -------------------------------------------

    /// `n` bytes at `at`, inside the records region.
    #[inline]
    fn get(&self, at: usize, n: usize) -> Result<&[u8], ArchiveError> {
        match at.checked_add(n) {
            Some(e) if e <= self.rec_end => Ok(&self.bytes()[at..e]),
            _ => corrupt(format!("read of {n} bytes at {at} past the records")),
        }
    }

    #[inline]
    fn byte(&self, at: usize) -> Result<u8, ArchiveError> {
        if at < self.rec_end {
            Ok(self.bytes()[at])
        } else {
            corrupt(format!("read at {at} past the records"))
        }
    }

    #[inline(always)]
    fn varint(&self, at: usize) -> Result<(u64, usize), ArchiveError> {
        get_varint(&self.bytes()[..self.rec_end], at)
    }

    #[inline]
    fn u64(&self, at: usize) -> Result<u64, ArchiveError> {
        Ok(u64::from_le_bytes(self.get(at, 8)?.try_into().unwrap()))
    }

    /// The target of the forward reference at `at`.
    #[inline]
    fn follow(&self, at: usize) -> Result<usize, ArchiveError> {
        let d = u32::from_le_bytes(self.get(at, REF)?.try_into().unwrap());
        if d == 0 {
            return corrupt(format!("reference at {at} points at itself"));
        }
        let t = at + d as usize;
        if t >= self.rec_end {
            return corrupt(format!("reference at {at} points past the records"));
        }
        Ok(t)
    }

    /// A count (varint) of items of `each` bytes following at `after`: checked to fit.
    #[inline(always)]
    fn count(&self, at: usize, each: usize) -> Result<(usize, usize), ArchiveError> {
        let (n, after) = self.varint(at)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(each))
            .and_then(|b| b.checked_add(after))
            .is_some_and(|e| e <= self.rec_end);
        if !fits {
            return count_past_end(n, at);
        }
        Ok((n as usize, after))
    }

    #[inline]
    fn shape(&self, id: u64) -> Result<&ShapeInfo, ArchiveError> {
        self.shapes
            .get(id as usize)
            .ok_or_else(|| ArchiveError::Corrupt(format!("shape {id} out of range")))
    }

    // --- records and validation ---------------------------------------------------------

    /// [start, end) of record `rec`, checked to lie in the records region.
    #[inline(always)]
    fn span(&self, rec: u64) -> Result<(usize, usize), ArchiveError> {
        match self.span_small(rec) {
            Some(span) => Ok(span),
            None => corrupt(format!("record {rec}: span out of bounds")),
        }
    }

    /// [`Self::span`] without its error value (`None` where it errs).
    #[inline(always)]
    fn span_small(&self, rec: u64) -> Option<(usize, usize)> {
        let (s, l) = record_span(self.bytes(), self.header.index_off, rec)?;
        let e = s.checked_add(l)?;
        (s >= HEADER_LEN as u64 && l > 0 && e <= self.rec_end as u64)
            .then_some((s as usize, e as usize))
    }
}

/// A sequence's layout (`Reader::seq`). Plain fields rather than an enum with data, so
/// that building and reading one stays in registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqAt {
    rec: u32,
    /// The shape of a struct sequence's elements.
    shape: u32,
    kind: SeqKind,
    /// The element type of a packed sequence (unused otherwise).
    elem: Elem,
    /// Bytes per element: a reference, a packed element, a struct.
    step: usize,
    pub len: usize,
    at: usize,
}

impl SeqAt {
    /// The shape of every item, for a sequence of shaped dicts (`None` for other layouts).
    #[inline(always)]
    pub fn struct_shape(&self) -> Option<u32> {
        (self.kind == SeqKind::Struct).then_some(self.shape)
    }

    /// Item `i` of a sequence of shaped dicts, as [`Reader::seq_get`] makes it, for a caller
    /// that knows `i < len` (`None` for other layouts, or `i` out of range).
    #[inline(always)]
    pub fn struct_item(&self, i: usize) -> Option<Node> {
        if self.kind != SeqKind::Struct || i >= self.len {
            return None;
        }
        // `i < len` and `at + len * step` was checked to be inside the records.
        Some(Node {
            rec: self.rec,
            form: Form::Struct(self.shape),
            pos: (self.at + i * self.step) as u64,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum SeqKind {
    Refs,
    Packed,
    Struct,
}
