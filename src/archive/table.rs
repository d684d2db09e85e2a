//! The on-disk hash table of dict archives (docs/format.md, "The dict table"): its size, where
//! a hash starts probing, and the 16-byte slot layout. The builder writes slots and the reader
//! probes them through this module only.

/// Bytes per slot.
pub const SLOT: usize = 16;
/// Load factor <= 0.75: capacity >= entries * NUM / DEN.
const NUM: u64 = 4;
const DEN: u64 = 3;

/// Slots in the table of a dict archive with `count` entries: >= count * 4/3, at least 8.
pub fn capacity(count: u64) -> u64 {
    (count * NUM / DEN + 1).max(8)
}

/// The first slot to probe for `hash` in a table of `cap` slots (multiply-shift range
/// reduction: uses the hash's high bits, while the slot's tag holds its low 32 bits).
#[inline]
pub fn home(hash: u64, cap: u64) -> u64 {
    ((hash as u128 * cap as u128) >> 64) as u64
}

/// One slot: `tag u32` (low 32 bits of the key hash), `entry + 1 u32` (0 = empty), and two
/// hints that let a reader start loading the key and the record before it has read the keys'
/// offsets and the index: `key u32` (offset of the key in the key blob, `u32::MAX` = none) and
/// `end64 u32` (record span end / 64, 0 = none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub tag: u32,
    pub entry1: u32,
    pub key: u32,
    pub end64: u32,
}

impl Slot {
    /// A filled slot for `entry` (hints saturate to "none" when they do not fit).
    pub fn new(hash: u64, entry: u32, key_offset: u64, span_end: u64) -> Self {
        Slot {
            tag: hash as u32,
            entry1: entry + 1,
            key: u32::try_from(key_offset).unwrap_or(u32::MAX),
            end64: u32::try_from(span_end / 64).unwrap_or(0),
        }
    }

    /// Read a slot from its 16 bytes.
    #[inline]
    pub fn read(b: &[u8]) -> Self {
        Slot {
            tag: super::u32_at(b, 0),
            entry1: super::u32_at(b, 4),
            key: super::u32_at(b, 8),
            end64: super::u32_at(b, 12),
        }
    }

    pub fn write(&self, b: &mut [u8]) {
        for (i, v) in [self.tag, self.entry1, self.key, self.end64]
            .iter()
            .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The entry this slot names, if it is not empty.
    #[inline]
    pub fn entry(&self) -> Option<u64> {
        (self.entry1 != 0).then(|| self.entry1 as u64 - 1)
    }

    /// The key hint as an offset into the key blob.
    #[inline]
    pub fn key_hint(&self) -> Option<usize> {
        (self.key != u32::MAX).then_some(self.key as usize)
    }

    /// The record hint: a position in the 64 bytes before which the record's span ends.
    #[inline]
    pub fn end_hint(&self) -> Option<usize> {
        (self.end64 != 0).then(|| self.end64 as usize * 64)
    }
}
