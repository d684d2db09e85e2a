//! The hash tables of the format (docs/format.md, "The dict table"), and the one rule for
//! where a hash starts probing ([`home`]), shared by both:
//! - the table of a dict archive (a `SharedDict`): its size and 16-byte slots;
//! - the index inside a stored dict of more than `DICT_INDEX_MIN` entries
//!   (the general dict layout): `entry + 1` per slot.
//!
//! Both probe linearly from `home`, wrapping, for at most their capacity. The builder writes
//! them and the reader probes them through this module only.

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

/// The slot after `i` in a table of `cap` slots (wrapping).
#[inline]
pub fn next(i: usize, cap: usize) -> usize {
    if i + 1 == cap {
        0
    } else {
        i + 1
    }
}

/// Slots in the index of a stored dict with `entries` entries: a power of two >= 2 entries
/// (load <= 0.5: every probe of this index compares a key, so chains are kept short).
pub fn record_index_capacity(entries: usize) -> usize {
    (entries * 2).next_power_of_two()
}

/// The index of a stored dict: `entry + 1` (0 = empty) for each entry of `hashes` (the
/// stable key hashes, in entry order), placed by linear probing from [`home`].
pub fn record_index(hashes: &[u64]) -> Vec<u32> {
    let cap = record_index_capacity(hashes.len());
    let mut slots = vec![0u32; cap];
    for (e, &h) in hashes.iter().enumerate() {
        let mut i = home(h, cap as u64) as usize;
        while slots[i] != 0 {
            i = next(i, cap);
        }
        slots[i] = e as u32 + 1;
    }
    slots
}

/// One slot: `tag u32` (low 32 bits of the key hash), `entry + 1 u32` (0 = empty), and two
/// hints that let a reader start loading the key and the record before it has read the keys'
/// offsets and the index: `key u32` (offset of the key in the key blob, `u32::MAX` = none) and
/// `start64 u32` (record start / 64, 0 = none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub tag: u32,
    pub entry1: u32,
    pub key: u32,
    pub start64: u32,
}

impl Slot {
    /// A filled slot for `entry` (hints saturate to "none" when they do not fit).
    pub fn new(hash: u64, entry: u32, key_offset: u64, record_start: u64) -> Self {
        Slot {
            tag: hash as u32,
            entry1: entry + 1,
            key: u32::try_from(key_offset).unwrap_or(u32::MAX),
            start64: u32::try_from(record_start / 64).unwrap_or(0),
        }
    }

    /// Read a slot from its 16 bytes.
    #[inline]
    pub fn read(b: &[u8]) -> Self {
        Slot {
            tag: super::u32_at(b, 0),
            entry1: super::u32_at(b, 4),
            key: super::u32_at(b, 8),
            start64: super::u32_at(b, 12),
        }
    }

    pub fn write(&self, b: &mut [u8]) {
        for (i, v) in [self.tag, self.entry1, self.key, self.start64]
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

    /// The record hint: the record starts in the 64 bytes from this position.
    #[inline]
    pub fn start_hint(&self) -> Option<usize> {
        (self.start64 != 0).then(|| self.start64 as usize * 64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn home_is_in_range_and_uses_the_high_bits() {
        for cap in [1u64, 7, 8, 1000, 1 << 20] {
            for h in [
                0u64,
                1,
                u64::MAX,
                0x8000_0000_0000_0000,
                0xdead_beef_0bad_f00d,
            ] {
                assert!(home(h, cap) < cap);
            }
        }
        assert_eq!(home(u64::MAX, 16), 15);
        assert_eq!(home(0x8000_0000_0000_0000, 16), 8);
        assert_eq!(home(0xffff_ffff, 16), 0); // low bits alone never move the home slot
    }

    #[test]
    fn capacities() {
        assert_eq!(capacity(0), 8);
        assert_eq!(capacity(100), 134);
        assert_eq!(record_index_capacity(9), 32);
        assert_eq!(record_index_capacity(16), 32);
        assert_eq!(record_index_capacity(17), 64);
    }

    /// Where a probe for `h` ends in `index`: the entry, or None at an empty slot.
    fn probe(index: &[u32], h: u64, mut eq: impl FnMut(usize) -> bool) -> Option<usize> {
        let mut i = home(h, index.len() as u64) as usize;
        for _ in 0..index.len() {
            let e = index[i] as usize;
            if e == 0 {
                return None;
            }
            if eq(e - 1) {
                return Some(e - 1);
            }
            i = next(i, index.len());
        }
        None
    }

    #[test]
    fn record_index_places_every_entry_on_its_probe_path() {
        // Colliding homes (equal high bits) included: they chain, wrapping at the end.
        let mut hashes: Vec<u64> = (0..40u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        hashes.extend([u64::MAX, u64::MAX - 1, u64::MAX - 2]);
        let index = record_index(&hashes);
        assert_eq!(index.len(), record_index_capacity(hashes.len()));
        assert_eq!(index.iter().filter(|&&e| e != 0).count(), hashes.len());
        for (e, &h) in hashes.iter().enumerate() {
            assert_eq!(probe(&index, h, |x| x == e), Some(e));
        }
        // An absent hash stops at an empty slot (load <= 0.5 leaves some).
        assert_eq!(probe(&index, 12345, |_| false), None);
    }
}
