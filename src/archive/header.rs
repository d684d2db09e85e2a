//! The fixed 128-byte header at offset 0 of every archive. See docs/format.md.

use xxhash_rust::xxh3::Xxh3Default;

use super::ArchiveError;

pub const MAGIC: [u8; 8] = *b"SHMSTOR\0";
pub const VERSION: u16 = 4;
pub const HEADER_LEN: usize = 128;
/// Out-of-line payloads (array data, big bytes) start on this boundary (absolute position).
pub const PAYLOAD_ALIGN: u64 = 64;
/// Size of one index entry: `start << 16 | length` (u64; length 0xFFFF = "the length is
/// the u64 just before the record").
pub const INDEX_ENTRY: usize = 8;
/// Size of one block entry: first record (u64), xxh3-64 of the block's records (u64).
pub const BLOCK_ENTRY: usize = 16;
/// Record lengths from this one up are stored before the record, not in its index entry.
pub const LONG_RECORD: u64 = 0xFFFF;
/// Records start below this position (48 bits of the index entry).
pub const MAX_RECORD_START: u64 = 1 << 48;

/// What the archive's records mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A sequence of records (`SharedList`).
    List = 1,
    /// Records addressed by key through a hash table (`SharedDict`).
    Dict = 2,
    /// Exactly one record (`put` / `Ref`).
    Object = 3,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::List),
            2 => Some(Kind::Dict),
            3 => Some(Kind::Object),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::List => "list",
            Kind::Dict => "dict",
            Kind::Object => "object",
        }
    }
}

/// The header's `i`th 8-byte field (after magic, version, kind and length), as stored; 0
/// when `bytes` is too short to hold it.
fn field(bytes: &[u8], i: usize) -> u64 {
    bytes
        .get(16 + 8 * i..24 + 8 * i)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// The parsed header. All offsets are absolute byte positions in the archive. The regions
/// follow one another in this order: records | index | blocks | symbols | shapes | keys |
/// table, the last ending at `total_len`; each region's length is the distance to the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub total_len: u64,
    pub count: u64,
    pub index_off: u64,
    pub blocks_off: u64,
    pub symbols_off: u64,
    pub shapes_off: u64,
    pub keys_off: u64,
    pub table_off: u64,
    pub created_unix_ms: u64,
    pub creator_pid: u32,
    /// xxh3 of header bytes [0, 120) followed by the metadata region [index_off, total_len).
    pub checksum: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10] = self.kind as u8;
        b[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        let fields = [
            self.total_len,
            self.count,
            self.index_off,
            self.blocks_off,
            self.symbols_off,
            self.shapes_off,
            self.keys_off,
            self.table_off,
            self.created_unix_ms,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        b[88..92].copy_from_slice(&self.creator_pid.to_le_bytes());
        b[120..128].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    pub fn blocks(&self) -> u64 {
        (self.symbols_off - self.blocks_off) / BLOCK_ENTRY as u64
    }
    pub fn symbols_len(&self) -> u64 {
        self.shapes_off - self.symbols_off
    }
    pub fn keys_len(&self) -> u64 {
        self.table_off - self.keys_off
    }
    pub fn table_len(&self) -> u64 {
        self.total_len - self.table_off
    }

    /// The bytes of metadata (`[index_off, total_len)`) the header of `bytes` claims, read
    /// without any check: what [`Header::parse`] hashes and `Reader::open` parses, so a
    /// caller can tell short work from long before opening (0 when `bytes` is shorter than
    /// a header). A forged value only changes that choice: `parse` checks the same fields.
    pub fn metadata_len_unchecked(bytes: &[u8]) -> u64 {
        field(bytes, 0).saturating_sub(field(bytes, 2))
    }

    /// Parse and check the header against the archive bytes: magic, version, sizes,
    /// region bounds and the metadata checksum. O(metadata size), not O(archive size).
    pub fn parse(bytes: &[u8]) -> Result<Header, ArchiveError> {
        let corrupt = |m: String| Err(ArchiveError::Corrupt(m));
        if bytes.len() < HEADER_LEN {
            return corrupt(format!(
                "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ));
        }
        if bytes[0..8] == UNSEALED_MAGIC {
            return Err(ArchiveError::Unsealed);
        }
        if bytes[0..8] != MAGIC {
            return corrupt("not a shmstore archive (bad magic)".into());
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != VERSION {
            return Err(ArchiveError::Version(version));
        }
        let kind = Kind::from_u8(bytes[10])
            .ok_or_else(|| ArchiveError::Corrupt(format!("unknown kind {}", bytes[10])))?;
        let hl = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        if hl != HEADER_LEN {
            return corrupt(format!("bad header length {hl}"));
        }
        let f = |i: usize| field(bytes, i);
        let h = Header {
            kind,
            total_len: f(0),
            count: f(1),
            index_off: f(2),
            blocks_off: f(3),
            symbols_off: f(4),
            shapes_off: f(5),
            keys_off: f(6),
            table_off: f(7),
            created_unix_ms: f(8),
            creator_pid: u32::from_le_bytes(bytes[88..92].try_into().unwrap()),
            checksum: u64::from_le_bytes(bytes[120..128].try_into().unwrap()),
        };
        if h.total_len != bytes.len() as u64 {
            return corrupt(format!(
                "truncated or resized: header says {} bytes, found {}",
                h.total_len,
                bytes.len()
            ));
        }
        let index_len = h.count.checked_mul(INDEX_ENTRY as u64);
        let regions_ok = index_len.is_some_and(|il| {
            h.index_off >= HEADER_LEN as u64
                && h.index_off.checked_add(il) == Some(h.blocks_off)
                && h.blocks_off <= h.symbols_off
                && (h.symbols_off - h.blocks_off) % BLOCK_ENTRY as u64 == 0
                && h.symbols_off <= h.shapes_off
                && h.shapes_off <= h.keys_off
                && h.keys_off <= h.table_off
                && h.table_off <= h.total_len
        });
        if !regions_ok {
            return corrupt("region offsets are inconsistent".into());
        }
        if kind == Kind::Object && h.count != 1 {
            return corrupt(format!("object archive with {} records", h.count));
        }
        if h.checksum != meta_checksum(bytes, h.index_off) {
            return corrupt("header/index checksum mismatch".into());
        }
        Ok(h)
    }
}

/// Checksum over the header (minus the checksum field) and the metadata region.
pub fn meta_checksum(bytes: &[u8], index_off: u64) -> u64 {
    checksum_parts(&bytes[..120], &bytes[index_off as usize..])
}

/// The metadata checksum from its two parts: header bytes [0, 120) and the metadata.
pub fn checksum_parts(head: &[u8], meta: &[u8]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(head);
    h.update(meta);
    h.digest()
}

/// Magic of an archive still being written (never valid for readers).
pub const UNSEALED_MAGIC: [u8; 8] = *b"SHMSTOR\x01";

/// The position and length of record `rec` from its index entry (unchecked: the reader
/// bounds-checks; here out-of-range answers are `None`).
#[inline(always)]
pub fn record_span(bytes: &[u8], index_off: u64, rec: u64) -> Option<(u64, u64)> {
    let at = rec
        .checked_mul(INDEX_ENTRY as u64)?
        .checked_add(index_off)? as usize;
    let e = u64::from_le_bytes(bytes.get(at..at.checked_add(8)?)?.try_into().ok()?);
    let (start, len) = (e >> 16, e & LONG_RECORD);
    if len != LONG_RECORD {
        return Some((start, len));
    }
    let s = usize::try_from(start).ok()?;
    let long = bytes.get(s.checked_sub(8)?..s)?;
    Some((start, u64::from_le_bytes(long.try_into().ok()?)))
}

/// Recompute every checksum of an edited archive, as a forger would: each block's checksum
/// (where its records' index entries still point inside the file) and the metadata
/// checksum (where `index_off` still does). Used by tests and the fuzzer (`archive::fuzz`)
/// to get arbitrary structure past the checksums, so that the structural checks are what
/// is tested.
#[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
pub fn reseal(bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN {
        return;
    }
    let field = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (count, index_off, blocks_off, symbols_off) = (
        field(bytes, 24),
        field(bytes, 32),
        field(bytes, 40),
        field(bytes, 48),
    );
    let len = bytes.len() as u64;
    if blocks_off <= symbols_off && symbols_off <= len {
        let n = (symbols_off - blocks_off) / BLOCK_ENTRY as u64;
        for b in 0..n {
            let at = (blocks_off + b * BLOCK_ENTRY as u64) as usize;
            let first = field(bytes, at);
            let last = if b + 1 < n {
                field(bytes, at + BLOCK_ENTRY)
            } else {
                count
            };
            let mut h = Xxh3Default::new();
            let mut rec = first;
            while rec < last.min(count) && rec - first < 1 << 20 {
                if let Some((s, l)) = record_span(bytes, index_off, rec) {
                    if let Some(e) = s.checked_add(l).filter(|&e| e <= len) {
                        h.update(&bytes[s as usize..e as usize]);
                    }
                }
                rec += 1;
            }
            let sum = h.digest();
            bytes[at + 8..at + 16].copy_from_slice(&sum.to_le_bytes());
        }
    }
    if index_off <= len {
        let sum = meta_checksum(bytes, index_off);
        bytes[120..128].copy_from_slice(&sum.to_le_bytes());
    }
}
