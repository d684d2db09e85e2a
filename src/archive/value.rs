//! The value model: what one record of an archive can hold.
//!
//! A record is serialized with rkyv into the segment; readers access it in place
//! (`ArchivedValue`) without deserializing. Large byte payloads (numpy array data, big
//! `bytes`) are written *out of line*, before the record's rkyv bytes and inside the same
//! record span, so that they are 64-byte aligned and never pass through a temporary buffer.

use rkyv::{Archive, Deserialize, Serialize};

/// Where an out-of-line payload lives, relative to the start of its record span.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

/// A numpy array: dtype as numpy's array-interface `typestr` (e.g. `<f8`), C-order shape,
/// and the extent of its C-contiguous data.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ArrayMeta {
    pub typestr: String,
    pub shape: Vec<u64>,
    pub data: Extent,
}

/// One stored value. The variants mirror the Python types shmstore accepts.
///
/// With rkyv's `unaligned` format an archived `Value` is 9 bytes (a tag and 8 bytes);
/// anything larger (array metadata, extents, indexed dicts) sits behind a `Box`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(deserialize_bounds(__D::Error: rkyv::rancor::Source))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext, __C::Error: rkyv::rancor::Source)))]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside i64: two's-complement little-endian bytes, minimal length.
    BigInt(Vec<u8>),
    Float(f64),
    /// A complex number (real, imaginary); boxed to keep `Value` at 9 bytes.
    Complex(Box<[f64; 2]>),
    Str(String),
    /// A str interned in the archive's symbol table (used for dict keys).
    Sym(u32),
    Bytes(Vec<u8>),
    /// Large bytes stored out of line.
    BytesExt(Box<Extent>),
    List(#[rkyv(omit_bounds)] Vec<Value>),
    Tuple(#[rkyv(omit_bounds)] Vec<Value>),
    /// A small dict: keys and values interleaved (`k0, v0, k1, v1, ...`), in insertion
    /// order, looked up by a linear scan.
    Dict(#[rkyv(omit_bounds)] Vec<Value>),
    /// A dict with more than [`DICT_INDEX_MIN`] entries, with a hash index.
    IndexedDict(#[rkyv(omit_bounds)] Box<IndexedDict>),
    Array(Box<ArrayMeta>),
}

/// Entries as in [`Value::Dict`], plus an open-addressing table of `entry + 1` (0 = empty)
/// over the stable key hash (`table::record_index`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(deserialize_bounds(__D::Error: rkyv::rancor::Source))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext, __C::Error: rkyv::rancor::Source)))]
pub struct IndexedDict {
    #[rkyv(omit_bounds)]
    pub items: Vec<Value>,
    pub index: Vec<u32>,
}

/// Dicts with more entries than this get a hash index inside the record.
pub const DICT_INDEX_MIN: usize = 8;

/// Containers (list, tuple, dict) nested in one record: the builder refuses deeper input.
pub const MAX_DEPTH: usize = 100;
/// Tuples nested inside one dict key (on top of [`MAX_DEPTH`]).
pub const MAX_KEY_DEPTH: usize = 32;
/// The deepest container nesting a well-formed record can hold: readers refuse deeper
/// values as corrupt (docs/format.md, "Depth").
pub const MAX_VALUE_DEPTH: usize = MAX_DEPTH + MAX_KEY_DEPTH;
/// The same limit counted as rkyv counts it while validating (pointers followed from the
/// record's root): the root itself, two per container (an indexed dict is a box holding a
/// vector) and two below the deepest one (an array's box and its shape). Validation stops
/// there, so its recursion is bounded by this, not by the bytes.
pub const MAX_SUBTREE_DEPTH: usize = 1 + 2 * MAX_VALUE_DEPTH + 2;

/// Whether a dict of `entries` entries is stored with an index (then [`Value::dict`] needs
/// the stable hash of every key).
pub fn dict_has_index(entries: usize) -> bool {
    entries > DICT_INDEX_MIN
}

impl Value {
    /// A stored dict from its interleaved `items` (`k0, v0, k1, v1, ...`) and, when
    /// [`dict_has_index`], the stable hash of each key (`hashes` is ignored otherwise).
    pub fn dict(items: Vec<Value>, hashes: &[u64]) -> Value {
        if dict_has_index(items.len() / 2) {
            let index = super::table::record_index(hashes);
            Value::IndexedDict(Box::new(IndexedDict { items, index }))
        } else {
            Value::Dict(items)
        }
    }
}

/// Item size in bytes of an array-interface typestr, if shmstore stores that dtype.
///
/// Accepted: bool (`|b1`), signed/unsigned ints of 1/2/4/8 bytes, floats of 2/4/8 bytes,
/// complex of 8/16 bytes, in either byte order.
pub fn typestr_itemsize(typestr: &str) -> Option<usize> {
    let b = typestr.as_bytes();
    // Bytes, not chars: the typestr comes from the file and may hold any UTF-8.
    if !(3..=4).contains(&b.len())
        || !matches!(b[0], b'<' | b'>' | b'|' | b'=')
        || !b[2..].iter().all(u8::is_ascii_digit)
        || b[2] == b'0'
    {
        return None;
    }
    let size = b[2..]
        .iter()
        .fold(0usize, |acc, d| acc * 10 + usize::from(d - b'0'));
    let ok = match b[1] {
        b'b' => size == 1,
        b'i' | b'u' => matches!(size, 1 | 2 | 4 | 8),
        b'f' => matches!(size, 2 | 4 | 8),
        b'c' => matches!(size, 8 | 16),
        _ => false,
    };
    ok.then_some(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archived_value_is_small() {
        assert_eq!(std::mem::size_of::<ArchivedValue>(), 9);
    }

    #[test]
    fn typestrs() {
        assert_eq!(typestr_itemsize("<f8"), Some(8));
        assert_eq!(typestr_itemsize("|b1"), Some(1));
        assert_eq!(typestr_itemsize("<c16"), Some(16));
        assert_eq!(typestr_itemsize(">i2"), Some(2));
        assert_eq!(typestr_itemsize("|O8"), None);
        assert_eq!(typestr_itemsize("<f3"), None);
        assert_eq!(typestr_itemsize("<U4"), None);
        assert_eq!(typestr_itemsize(""), None);
        // From crafted files: never a panic on non-ASCII or odd digits.
        assert_eq!(typestr_itemsize("<\u{e9}8"), None);
        assert_eq!(typestr_itemsize("<f\u{e9}"), None);
        assert_eq!(typestr_itemsize("\u{e9}f8"), None);
        assert_eq!(typestr_itemsize("<f+8"), None);
        assert_eq!(typestr_itemsize("<f0008"), None);
        assert_eq!(typestr_itemsize("<i08"), None);
    }
}
