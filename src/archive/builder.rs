//! Streaming archive builder: records are serialized one at a time straight into the
//! output (a segment file), so building needs memory for one record plus the metadata
//! (index, keys, hash table), never a second copy of the whole archive.

use std::io::{self, Seek, SeekFrom, Write};

use ahash::AHashMap;
use rkyv::rancor;
use rkyv::ser::allocator::Arena;
use rkyv::util::AlignedVec;
use xxhash_rust::xxh3::Xxh3Default;

use super::header::{
    checksum_parts, Header, Kind, HEADER_LEN, INDEX_ENTRY, PAYLOAD_ALIGN, SPAN_ALIGN,
    UNSEALED_MAGIC,
};
use super::key::Key;
use super::value::{Extent, Value};
use super::{table, u64_at, ArchiveError};

/// Most distinct strings the symbol table interns; later new keys are stored inline.
pub const MAX_SYMBOLS: usize = 1 << 16;
/// Longest str that is interned as a symbol.
pub const MAX_SYMBOL_LEN: usize = 128;

/// Builds one archive into `W`.
pub struct Builder<W: Write + Seek> {
    out: W,
    pos: u64,
    kind: Kind,
    index: Vec<u8>,
    count: u64,
    symbols: AHashMap<Box<str>, u32>,
    symbol_list: Vec<Box<str>>,
    // Dict kind only: encoded keys, their offsets, and a growing table of (hash, entry).
    keys: Vec<u8>,
    key_offsets: Vec<u64>,
    key_table: KeyTable,
    // The record being written.
    span_start: Option<u64>,
    span_hash: Xxh3Default,
    // Reused rkyv buffers.
    buf: AlignedVec,
    arena: Arena,
    creator_pid: u32,
}

impl<W: Write + Seek> Builder<W> {
    /// Start an archive; writes an *unsealed* header that readers refuse.
    pub fn new(mut out: W, kind: Kind, creator_pid: u32) -> Result<Self, ArchiveError> {
        let mut placeholder = [0u8; HEADER_LEN];
        placeholder[..8].copy_from_slice(&UNSEALED_MAGIC);
        out.write_all(&placeholder)?;
        Ok(Builder {
            out,
            pos: HEADER_LEN as u64,
            kind,
            index: Vec::new(),
            count: 0,
            symbols: AHashMap::new(),
            symbol_list: Vec::new(),
            keys: Vec::new(),
            key_offsets: vec![0],
            key_table: KeyTable::default(),
            span_start: None,
            span_hash: Xxh3Default::new(),
            buf: AlignedVec::new(),
            arena: Arena::new(),
            creator_pid,
        })
    }

    fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        if self.span_start.is_some() {
            self.span_hash.update(bytes);
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        let pad = (align - self.pos % align) % align;
        self.write_raw(&ZEROS[..pad as usize])
    }

    fn ensure_span(&mut self) -> io::Result<u64> {
        if let Some(s) = self.span_start {
            return Ok(s);
        }
        // Padding before a span is outside it (and outside its checksum).
        let pad = (SPAN_ALIGN - self.pos % SPAN_ALIGN) % SPAN_ALIGN;
        self.out.write_all(&[0u8; 8][..pad as usize])?;
        self.pos += pad;
        self.span_start = Some(self.pos);
        self.span_hash.reset();
        Ok(self.pos)
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

    /// Write an out-of-line payload for the record being built (64-byte aligned).
    pub fn write_payload(&mut self, bytes: &[u8]) -> Result<Extent, ArchiveError> {
        let start = self.ensure_span()?;
        self.pad_to(PAYLOAD_ALIGN)?;
        let offset = self.pos - start;
        self.write_raw(bytes)?;
        Ok(Extent {
            offset,
            len: bytes.len() as u64,
        })
    }

    /// Dict kind: register the key of the next record. Call before [`Self::finish_record`].
    /// Fails on a duplicate key, before anything of the record is written.
    pub fn add_key(&mut self, key: &Key<'_>) -> Result<(), ArchiveError> {
        if self.kind != Kind::Dict || self.key_offsets.len() as u64 != self.count + 1 {
            return Err(ArchiveError::Invalid(
                "add_key: not a dict, or a key is pending".into(),
            ));
        }
        let hash = key.stable_hash();
        let entry = self.count;
        if entry >= u32::MAX as u64 {
            return Err(ArchiveError::Invalid("more than 4294967294 entries".into()));
        }
        let keys = &self.keys;
        let offs = &self.key_offsets;
        let existing = self.key_table.find(hash, |e| {
            let (k, _) = super::key::decode_key(&keys[offs[e as usize] as usize..])
                .expect("keys written by this builder decode");
            k.key_eq(key)
        });
        if let Some(e) = existing {
            return Err(ArchiveError::DuplicateKey(e));
        }
        key.encode(&mut self.keys);
        self.key_offsets.push(self.keys.len() as u64);
        self.key_table.insert(hash, entry as u32);
        Ok(())
    }

    /// Serialize `value` as the next record, closing its span.
    pub fn finish_record(&mut self, value: &Value) -> Result<(), ArchiveError> {
        if self.kind == Kind::Dict && self.key_offsets.len() as u64 != self.count + 2 {
            return Err(ArchiveError::Invalid(
                "dict record written without its key".into(),
            ));
        }
        if self.kind == Kind::Object && self.count == 1 {
            return Err(ArchiveError::Invalid(
                "an object archive holds one record".into(),
            ));
        }
        let start = self.ensure_span()?;
        self.pad_to(8)?;
        let buf = std::mem::take(&mut self.buf);
        let buf = rkyv::api::high::to_bytes_in_with_alloc::<_, _, rancor::Error>(
            value,
            buf,
            self.arena.acquire(),
        )
        .map_err(|e| ArchiveError::Invalid(format!("record could not be serialized: {e}")))?;
        let res = self.write_raw(&buf);
        self.buf = buf;
        self.buf.clear();
        res?;
        self.close_span(start);
        Ok(())
    }

    /// Write already-serialized rkyv bytes (root value last) as the next record, unchecked.
    /// Only for the fuzzer (`archive::fuzz`), which crafts records no `Value` can make
    /// without deep recursion (tens of thousands of nesting levels).
    #[doc(hidden)]
    pub fn finish_raw_record(&mut self, rkyv_bytes: &[u8]) -> Result<(), ArchiveError> {
        if self.kind == Kind::Dict && self.key_offsets.len() as u64 != self.count + 2 {
            return Err(ArchiveError::Invalid(
                "dict record written without its key".into(),
            ));
        }
        let start = self.ensure_span()?;
        self.pad_to(8)?;
        self.write_raw(rkyv_bytes)?;
        self.close_span(start);
        Ok(())
    }

    fn close_span(&mut self, start: u64) {
        let end = self.pos;
        let hash = self.span_hash.digest();
        self.span_start = None;
        self.index.extend_from_slice(&start.to_le_bytes());
        self.index.extend_from_slice(&end.to_le_bytes());
        self.index.extend_from_slice(&hash.to_le_bytes());
        self.count += 1;
    }

    /// Write the metadata and seal the header. Returns the output and the total size.
    pub fn finish(mut self, created_unix_ms: u64) -> Result<(W, u64), ArchiveError> {
        if self.kind == Kind::Object && self.count != 1 {
            return Err(ArchiveError::Invalid(
                "an object archive needs one record".into(),
            ));
        }
        self.span_start = None;
        self.pad_to(8)?;
        let index_off = self.pos;
        let mut meta = std::mem::take(&mut self.index);
        debug_assert_eq!(meta.len() as u64, self.count * INDEX_ENTRY as u64);
        // Symbols: count u32, offsets u32 * (n + 1), utf-8 blob; padded to 8.
        let symbols_off = index_off + meta.len() as u64;
        let sym_start = meta.len();
        meta.extend_from_slice(&(self.symbol_list.len() as u32).to_le_bytes());
        let mut acc = 0u32;
        meta.extend_from_slice(&acc.to_le_bytes());
        for s in &self.symbol_list {
            acc += s.len() as u32;
            meta.extend_from_slice(&acc.to_le_bytes());
        }
        for s in &self.symbol_list {
            meta.extend_from_slice(s.as_bytes());
        }
        while meta.len() % 8 != 0 {
            meta.push(0);
        }
        let symbols_len = (meta.len() - sym_start) as u64;
        // Keys (dict): offsets u64 * (count + 1), encoded keys; padded to 8.
        let keys_off = index_off + meta.len() as u64;
        let keys_start = meta.len();
        if self.kind == Kind::Dict {
            for o in &self.key_offsets {
                meta.extend_from_slice(&o.to_le_bytes());
            }
            meta.extend_from_slice(&self.keys);
            while meta.len() % 8 != 0 {
                meta.push(0);
            }
        }
        let keys_len = (meta.len() - keys_start) as u64;
        // Table (dict): see `table`.
        let table_off = index_off + meta.len() as u64;
        let table_start = meta.len();
        if self.kind == Kind::Dict {
            let span_end = |e: u32| u64_at(&meta, e as usize * INDEX_ENTRY + 8);
            let slots = self
                .key_table
                .final_slots(self.count, &self.key_offsets, span_end);
            meta.extend_from_slice(&slots);
        }
        let table_len = (meta.len() - table_start) as u64;
        let total_len = index_off + meta.len() as u64;
        let mut header = Header {
            kind: self.kind,
            total_len,
            count: self.count,
            index_off,
            symbols_off,
            symbols_len,
            keys_off,
            keys_len,
            table_off,
            table_len,
            created_unix_ms,
            creator_pid: self.creator_pid,
            checksum: 0,
        };
        header.checksum = checksum_parts(&header.encode()[..120], &meta);
        self.write_raw(&meta)?;
        self.out.seek(SeekFrom::Start(0))?;
        self.out.write_all(&header.encode())?;
        self.out.flush()?;
        Ok((self.out, total_len))
    }
}

/// An in-memory open-addressing table of (hash, entry) used while building a dict.
#[derive(Default)]
struct KeyTable {
    slots: Vec<(u64, u32)>, // (hash, entry + 1); entry + 1 == 0 means empty
    len: usize,
}

impl KeyTable {
    fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let cap = self.slots.len();
        let mut i = table::home(hash, cap as u64) as usize;
        loop {
            let (h, e) = self.slots[i];
            if e == 0 {
                return None;
            }
            if h == hash && eq(e - 1) {
                return Some(e - 1);
            }
            i = table::next(i, cap);
        }
    }

    fn insert(&mut self, hash: u64, entry: u32) {
        if (self.len + 1) * 2 > self.slots.len() {
            let cap = (self.slots.len() * 2).max(16);
            let old = std::mem::replace(&mut self.slots, vec![(0, 0); cap]);
            self.len = 0;
            for (h, e) in old.into_iter().filter(|s| s.1 != 0) {
                self.insert_slot(h, e);
            }
        }
        self.insert_slot(hash, entry + 1);
    }

    fn insert_slot(&mut self, hash: u64, e1: u32) {
        let cap = self.slots.len();
        let mut i = table::home(hash, cap as u64) as usize;
        while self.slots[i].1 != 0 {
            i = table::next(i, cap);
        }
        self.slots[i] = (hash, e1);
        self.len += 1;
    }

    /// The on-disk table (`table`): linear probing from `table::home`, wrapping.
    fn final_slots(
        &self,
        count: u64,
        key_offsets: &[u64],
        span_end: impl Fn(u32) -> u64,
    ) -> Vec<u8> {
        let cap = table::capacity(count) as usize;
        let mut used = vec![false; cap];
        let mut out = vec![0u8; cap * table::SLOT];
        for &(h, e1) in self.slots.iter().filter(|s| s.1 != 0) {
            let mut i = table::home(h, cap as u64) as usize;
            while used[i] {
                i = table::next(i, cap);
            }
            used[i] = true;
            let e = e1 - 1;
            table::Slot::new(h, e, key_offsets[e as usize], span_end(e))
                .write(&mut out[i * table::SLOT..(i + 1) * table::SLOT]);
        }
        out
    }
}
