//! Lookups: the key table of a dict store, the indexes of indexed dicts, and confirming
//! that a miss is real (not hidden by a forged index).

use super::*;

impl<B: AsRef<[u8]>> Reader<B> {
    /// A lookup in record `rec` missed in an indexed dict: make sure that is because the key
    /// is absent, not because a forged index hides it. The first miss in a record checks
    /// every indexed dict of the record (each entry must be found from its key's hash);
    /// later misses are free. `Corrupt` if an index does not find one of its entries.
    pub fn confirm_miss(&self, rec: u64) -> Result<(), ArchiveError> {
        self.validate_record(rec)?;
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        let checked = self.indexes_checked.get_or_init(|| {
            (0..self.header.count.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect()
        });
        if checked[word].load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        let (s, e) = self.span(rec)?;
        let mut dicts = Vec::new();
        self.walk(s, e, |pos, tag| {
            if tag == T_DICT {
                dicts.push(pos);
            }
            Ok(())
        })?;
        for pos in dicts {
            let node = Node {
                rec: rec as u32,
                form: Form::Tagged,
                pos: pos as u64,
            };
            let n = self.dict_len(node)?;
            if !crate::archive::value::dict_has_index(n) {
                continue;
            }
            for i in 0..n {
                let k = self.item_key(self.dict_key(node, i)?)?;
                if !k.key_eq(&k) {
                    // A key that equals nothing (a NaN, or a tuple holding one) is found
                    // by no lookup, as in a Python dict: there is nothing to confirm.
                    continue;
                }
                let found =
                    self.general_find(node, k.stable_hash(), |c| Ok(self.item_key(c)?.key_eq(&k)))?;
                if found != Some(i) {
                    return corrupt(format!(
                        "record {rec}: a dict's hash index does not find its entry {i}"
                    ));
                }
            }
        }
        checked[word].fetch_or(bit, Ordering::AcqRel);
        Ok(())
    }

    /// A stored dict key as a `Key` (`Corrupt` for a value that cannot be a key).
    pub fn item_key<'s>(&'s self, item: Item<'s>) -> Result<Key<'s>, ArchiveError> {
        self.item_key_depth(item, 0)
    }

    pub(super) fn item_key_depth<'s>(
        &'s self,
        item: Item<'s>,
        depth: usize,
    ) -> Result<Key<'s>, ArchiveError> {
        use std::borrow::Cow::Borrowed;
        Ok(match item {
            Item::None => Key::None,
            Item::Bool(b) => Key::Bool(b),
            Item::Int(i) => Key::Int(i),
            Item::BigInt(b) if crate::archive::key::bigint_is_canonical(b) => {
                Key::BigInt(Borrowed(b))
            }
            Item::BigInt(_) => {
                return corrupt("an int dict key that is not in its shortest form");
            }
            Item::Float(f) => Key::Float(f),
            Item::Str(s) => Key::Str(Borrowed(stored_str(s)?)),
            Item::Sym(id) => Key::Str(Borrowed(self.symbol(id)?)),
            Item::Bytes(b) => Key::Bytes(Borrowed(b)),
            Item::Tuple(node) if depth < MAX_KEY_DEPTH => {
                let n = self.seq_len(node)?;
                Key::Tuple(
                    (0..n)
                        .map(|i| self.item_key_depth(self.seq_item(node, i)?, depth + 1))
                        .collect::<Result<_, _>>()?,
                )
            }
            _ => return corrupt("a dict key of a type that cannot be a key"),
        })
    }

    // --- symbols and the dict archive's keys ----------------------------------------------

    /// Number of interned symbols.
    pub fn symbol_count(&self) -> usize {
        self.symbols.len()
    }

    /// An interned string.
    #[inline]
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
            let keys_end = self.header.table_off as usize;
            return self.probe(crate::archive::key::hash_str(s), |e, at| {
                let k = match at {
                    Some(at) if at < keys_end => &b[at..keys_end],
                    _ => self.key_bytes(e)?,
                };
                Ok(k.len() >= s.len() + 5
                    && k[0] == crate::archive::key::T_STR
                    && k[1..5] == (s.len() as u32).to_le_bytes()
                    && &k[5..5 + s.len()] == s.as_bytes())
            });
        }
        self.probe(key.stable_hash(), |e, _| Ok(self.key(e)?.key_eq(key)))
    }

    /// A dict table slot's entry `e`, checked to be one of the archive's.
    #[inline]
    pub(super) fn table_entry(&self, e: u64) -> Result<u64, ArchiveError> {
        if e >= self.header.count {
            return corrupt(format!(
                "dict table slot points at entry {e} of {}",
                self.header.count
            ));
        }
        Ok(e)
    }

    /// The encoded bytes of key `i` (bounds-checked).
    pub(super) fn key_bytes(&self, i: u64) -> Result<&[u8], ArchiveError> {
        let b = self.bytes();
        let ko = self.header.keys_off as usize;
        let blob = ko + (self.header.count as usize + 1) * 8;
        let end = self.header.table_off as usize;
        let s = u64_at(b, ko + i as usize * 8) as usize;
        let e = u64_at(b, ko + (i as usize + 1) * 8) as usize;
        if s > e || blob.checked_add(e).is_none_or(|x| x > end) {
            return corrupt(format!("key {i}: offsets out of bounds"));
        }
        Ok(&b[blob + s..blob + e])
    }

    pub(super) fn probe(
        &self,
        h: u64,
        mut matches: impl FnMut(u64, Option<usize>) -> Result<bool, ArchiveError>,
    ) -> Result<Option<u64>, ArchiveError> {
        let b = self.bytes();
        let cap = self.header.table_len() / table::SLOT as u64; // checked at open: >= 8
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
                let e = self.table_entry(e)?;
                // Hints (docs/format.md, "The dict table"): start loading the key and the
                // record now, so that the misses on the key, the index and the record
                // overlap instead of following one another. The record hint is only
                // prefetched; the key hint also tells `matches` where the key is
                // (bounds-checked there, like the offsets).
                let key_at = slot.key_hint().map(|k| blob.saturating_add(k));
                if let Some(at) = key_at {
                    prefetch(b, at);
                }
                if let Some(start) = slot.start_hint() {
                    prefetch_lines(b, start, start.saturating_add(PREFETCH_AHEAD));
                }
                // And what reading the record will look at first: its index entry and, if it
                // is not checked yet in this process, its block's entries.
                self.prefetch_record(e);
                if !self.is_validated(e) {
                    self.prefetch_block(e);
                }
                if matches(e, key_at)? {
                    return Ok(Some(e));
                }
            }
            i = table::next(i as usize, cap as usize) as u64;
        }
        Ok(None)
    }
}
