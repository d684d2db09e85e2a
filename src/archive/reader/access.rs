//! Navigation: a record's root, values, sequences, dicts, payloads and arrays, all through
//! the bounds-checked reads of `mod.rs` and after the record's checks (`check.rs`).

use super::*;

impl<B: AsRef<[u8]>> Reader<B> {
    /// The root value of record `rec` (checked on first access in this process).
    #[inline(always)]
    pub fn root(&self, rec: u64) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (start, end) = self.span(rec)?;
        self.prefetch_root(start, end);
        Ok(Node {
            rec: rec as u32,
            form: Form::Tagged,
            pos: start as u64,
        })
    }

    /// The root of record `rec` if the record is checked already and its root is a shaped
    /// dict whose shape id fits one byte (a COCO record, say): the node that `root` then
    /// `item` give, read without their error values, for the tiny path of `lst[i]`. `None`
    /// for anything else (a record not yet checked, another root, whatever `root` or
    /// `tagged` would refuse), which then takes the whole way.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))] // the stable-ABI wheel keeps pyo3's slots
    pub fn root_dict_small(&self, rec: u64) -> Option<Node> {
        if rec >= self.header.count || !self.is_validated(rec) {
            return None;
        }
        let (start, end) = self.span_small(rec)?;
        self.prefetch_root(start, end);
        // The tag and a one-byte varint (the shape id), inside the record region as
        // `tagged` reads them.
        let [tag, id] = self.fixed::<2>(start)?;
        if tag != T_DICT_SHAPED || id >= 0x80 || usize::from(id) >= self.shapes.len() {
            return None;
        }
        Some(Node {
            rec: u32::try_from(rec).ok()?,
            form: Form::Struct(u32::from(id)),
            pos: start as u64 + 2,
        })
    }

    /// Ask for record [start, end)'s first lines at once: a record is read front to back,
    /// but its reads depend on one another (a field's position comes from what precedes
    /// it), so in random order their misses then overlap instead of following one another.
    /// Not the line of its first byte, which is read next anyway.
    #[inline(always)]
    fn prefetch_root(&self, start: usize, end: usize) {
        prefetch_lines(
            self.bytes(),
            (start | 63) + 1,
            end.min(start + ROOT_PREFETCH),
        );
    }

    /// Start loading record `rec` (its index entry, then its first bytes) without waiting.
    pub fn prefetch_record(&self, rec: u64) {
        let b = self.bytes();
        if rec < self.header.count {
            let at = self.header.index_off as usize + rec as usize * 8;
            prefetch(b, at);
        }
    }

    /// Start loading what checking record `rec`'s block reads first: where the block is
    /// expected in the table of first records ([`Self::block_of`]'s guess) and its checksum.
    pub fn prefetch_block(&self, rec: u64) {
        if self.blocks() == 0 || rec >= self.header.count {
            return;
        }
        let guess = self.block_guess(rec);
        #[cfg(target_arch = "x86_64")]
        if !self.alone() {
            let p = self.block_first[guess..].as_ptr();
            // SAFETY: as in `prefetch`: a hint that never faults, and `p` points into the
            // vector (`guess < n`).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p as *const i8,
                )
            };
        }
        let at = self.header.blocks_off as usize + guess * BLOCK_ENTRY + 8;
        prefetch(self.bytes(), at);
    }

    /// Second step of [`Self::prefetch_record`]: the record's bytes (its index entry is
    /// read, which waits for it if it was not prefetched).
    pub fn prefetch_body(&self, rec: u64) {
        if let Some((s, _)) = record_span(self.bytes(), self.header.index_off, rec) {
            let s = s as usize;
            prefetch(self.bytes(), s);
            prefetch(self.bytes(), s.saturating_add(64));
        }
    }

    /// Rebuild a node from an untrusted (record, position, form), e.g. from a pickle.
    pub fn node_from(&self, rec: u64, pos: u64, form: (u8, u32)) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (s, e) = self.span(rec)?;
        let form = match form {
            (0, 0) => Form::Tagged,
            (1, s) => {
                self.shape(s as u64)?;
                Form::Struct(s)
            }
            (2, c) => match Enc::decode([6, (c >> 16) as u8, (c >> 8) as u8, c as u8]) {
                Some(Enc::Pack { elem, count, tuple }) => Form::Pack { elem, count, tuple },
                _ => return corrupt("bad node form"),
            },
            _ => return corrupt("bad node form"),
        };
        // A node of no bytes (the slots of a dict whose every value is None, an empty
        // packed field) may sit at the record's very end.
        let empty = match form {
            Form::Tagged => false,
            Form::Struct(id) => self.shape(u64::from(id))?.shape.size == 0,
            Form::Pack { count, .. } => count == 0,
        };
        if pos < s as u64 || pos > e as u64 || (pos == e as u64 && !empty) {
            return corrupt(format!("position {pos} is not inside record {rec}"));
        }
        Ok(Node {
            rec: rec as u32,
            form,
            pos,
        })
    }

    // --- values -------------------------------------------------------------------------

    /// The value a node names: a container node as List/Tuple/Dict, a tagged one decoded.
    #[inline(always)]
    pub fn item(&self, node: Node) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Tagged => self.tagged(node.rec, node.pos as usize),
            Form::Struct(_) => Ok(Item::Dict(node)),
            Form::Pack { tuple: true, .. } => Ok(Item::Tuple(node)),
            Form::Pack { .. } => Ok(Item::List(node)),
        }
    }

    /// The tagged value at `pos` of record `rec`.
    #[inline(always)]
    pub fn tagged(&self, rec: u32, pos: usize) -> Result<Item<'_>, ArchiveError> {
        let tag = self.byte(pos)?;
        let b = pos + 1;
        let node = |form| Node {
            rec,
            form,
            pos: pos as u64,
        };
        let blob = |at: usize| -> Result<&[u8], ArchiveError> {
            let (n, after) = self.count(at, 1)?;
            self.get(after, n)
        };
        Ok(match tag {
            T_NONE => Item::None,
            T_FALSE => Item::Bool(false),
            T_TRUE => Item::Bool(true),
            T_I8 => Item::Int(self.byte(b)? as i8 as i64),
            T_I16 => Item::Int(i16::from_le_bytes(self.get(b, 2)?.try_into().unwrap()) as i64),
            T_I32 => Item::Int(i32::from_le_bytes(self.get(b, 4)?.try_into().unwrap()) as i64),
            T_I64 => Item::Int(self.u64(b)? as i64),
            T_BIGINT => Item::BigInt(blob(b)?),
            T_F64 => Item::Float(f64::from_bits(self.u64(b)?)),
            T_COMPLEX => Item::Complex(
                f64::from_bits(self.u64(b)?),
                f64::from_bits(self.u64(b + 8)?),
            ),
            T_STR => Item::Str(blob(b)?),
            T_SYM => {
                let (id, _) = self.varint(b)?;
                if id >= self.symbols.len() as u64 {
                    return corrupt(format!("symbol {id} out of range"));
                }
                Item::Sym(id as u32)
            }
            T_BYTES => Item::Bytes(blob(b)?),
            T_BYTES_EXT => Item::BytesExt(self.ext_at(b)?),
            T_ARRAY => Item::Array(ArrayAt { pos: b as u64, rec }),
            T_LIST | T_LIST_PACKED | T_LIST_STRUCT => Item::List(node(Form::Tagged)),
            T_TUPLE | T_TUPLE_PACKED | T_TUPLE_STRUCT => Item::Tuple(node(Form::Tagged)),
            T_DICT_SHAPED => {
                let (id, after) = self.varint(b)?;
                self.shape(id)?;
                Item::Dict(Node {
                    rec,
                    form: Form::Struct(id as u32),
                    pos: after as u64,
                })
            }
            T_DICT => Item::Dict(node(Form::Tagged)),
            t => return corrupt(format!("unknown tag {t}")),
        })
    }

    pub(super) fn ext_at(&self, at: usize) -> Result<Extent, ArchiveError> {
        Ok(Extent {
            offset: self.u64(at)?,
            len: self.u64(at + 8)?,
            checksum: self.u64(at + 16)?,
        })
    }

    /// The end of an array's metadata starting at `at` (checked to be readable).
    pub(super) fn array_meta_end(&self, at: usize) -> Result<usize, ArchiveError> {
        let tl = self.byte(at)? as usize;
        let nd_at = at + 1 + tl;
        let nd = self.byte(nd_at)? as usize;
        let end = nd_at + 1 + nd * 8 + 24;
        self.get(at, end - at)?;
        Ok(end)
    }

    // --- sequences ----------------------------------------------------------------------

    /// Whether a list/tuple node is a tuple.
    pub fn is_tuple(&self, node: Node) -> bool {
        match node.form {
            Form::Pack { tuple, .. } => tuple,
            Form::Struct(_) => false,
            Form::Tagged => matches!(
                self.byte(node.pos as usize),
                Ok(T_TUPLE | T_TUPLE_PACKED | T_TUPLE_STRUCT)
            ),
        }
    }

    /// A sequence node's layout, read once: its length and how to reach item `i`.
    #[inline(always)]
    pub fn seq(&self, node: Node) -> Result<SeqAt, ArchiveError> {
        let pos = node.pos as usize;
        let seq = |kind, shape, elem: Elem, step, (len, at): (usize, usize)| SeqAt {
            rec: node.rec,
            shape,
            kind,
            elem,
            step,
            len,
            at,
        };
        match node.form {
            Form::Pack { elem, count, .. } => Ok(seq(
                SeqKind::Packed,
                0,
                elem,
                elem.size(),
                (count as usize, pos),
            )),
            Form::Struct(_) => corrupt("a dict is not a sequence"),
            Form::Tagged => {
                let tag = self.byte(pos)?;
                match tag {
                    T_LIST | T_TUPLE => Ok(seq(
                        SeqKind::Refs,
                        0,
                        Elem::I8,
                        REF,
                        self.count(pos + 1, REF)?,
                    )),
                    T_LIST_PACKED | T_TUPLE_PACKED => {
                        let elem = Elem::from_u8(self.byte(pos + 1)?)
                            .ok_or_else(|| ArchiveError::Corrupt("bad packed element".into()))?;
                        let n = self.count(pos + 2, elem.size())?;
                        Ok(seq(SeqKind::Packed, 0, elem, elem.size(), n))
                    }
                    T_LIST_STRUCT | T_TUPLE_STRUCT => {
                        let (id, at) = self.varint(pos + 1)?;
                        let size = self.shape(id)?.shape.size as usize;
                        let n = self.count(at, size)?;
                        Ok(seq(SeqKind::Struct, id as u32, Elem::I8, size, n))
                    }
                    _ => corrupt("not a sequence"),
                }
            }
        }
    }

    pub fn seq_len(&self, node: Node) -> Result<usize, ArchiveError> {
        Ok(self.seq(node)?.len)
    }

    /// Item `i` of a sequence node (`Invalid` if `i` is out of range).
    #[inline]
    pub fn seq_item(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        self.seq_get(self.seq(node)?, i)
    }

    /// Item `i` of a sequence whose layout is known (`Invalid` if `i` is out of range).
    #[inline(always)]
    pub fn seq_get(&self, seq: SeqAt, i: usize) -> Result<Item<'_>, ArchiveError> {
        if i >= seq.len {
            return Err(ArchiveError::Invalid(format!("index {i} out of range")));
        }
        // `i < len` and `at + len * step` was checked to be inside the records.
        let at = seq.at + i * seq.step;
        match seq.kind {
            SeqKind::Refs => self.tagged(seq.rec, self.follow(at)?),
            SeqKind::Packed => self.scalar(seq.elem, at),
            SeqKind::Struct => Ok(Item::Dict(Node {
                rec: seq.rec,
                form: Form::Struct(seq.shape),
                pos: at as u64,
            })),
        }
    }

    /// The element type and bytes of a packed sequence (`None` for other layouts), for
    /// reading all of its elements at once. The bytes hold exactly `seq.len` elements
    /// (checked when the layout was read).
    #[inline]
    pub fn packed(&self, seq: SeqAt) -> Option<(Elem, &[u8])> {
        if seq.kind != SeqKind::Packed {
            return None;
        }
        let bytes = self.get(seq.at, seq.len.checked_mul(seq.step)?).ok()?;
        Some((seq.elem, bytes))
    }

    /// Element `i` of a packed field whose node sits at `pos` (a `Form::Pack` of `elem`), as
    /// `seq_get` reads it, without first building the field's layout. The caller checked
    /// `i` against the field's count; the element's bytes are checked to be in the record.
    #[inline(always)]
    pub fn packed_get(&self, pos: u64, elem: Elem, i: usize) -> Result<Item<'_>, ArchiveError> {
        let at = i
            .checked_mul(elem.size())
            .and_then(|off| (pos as usize).checked_add(off))
            .ok_or_else(|| {
                ArchiveError::Corrupt("a packed element beyond the address space".into())
            })?;
        self.scalar(elem, at)
    }

    /// [`Self::packed_get`] for the smallest read path (`ListView`'s `view[i]`): the element
    /// as a scalar, or `None` wherever `packed_get` gives an error (the caller then takes
    /// the long way, which raises it). It makes no error value and each element type reads
    /// its own fixed width, so it stays a few instructions where it is inlined.
    #[inline(always)]
    pub fn packed_scalar(&self, pos: u64, elem: Elem, i: usize) -> Option<Scalar> {
        self.elem_at(elem, usize::try_from(pos).ok()?, i)
    }

    /// Element `i` of `elem`s starting at `base`, read at the element's fixed width if it is
    /// inside the records (`None` otherwise, or for a bool byte that is not 0 or 1): what
    /// `scalar` reads, without its error values (the tiny paths' reads).
    #[inline(always)]
    fn elem_at(&self, elem: Elem, base: usize, i: usize) -> Option<Scalar> {
        Some(match elem {
            Elem::F64 => Scalar::Float(f64::from_le_bytes(self.nth(base, i)?)),
            Elem::I64 => Scalar::Int(i64::from_le_bytes(self.nth(base, i)?)),
            Elem::I32 => Scalar::Int(i32::from_le_bytes(self.nth(base, i)?).into()),
            Elem::I16 => Scalar::Int(i16::from_le_bytes(self.nth(base, i)?).into()),
            Elem::I8 => Scalar::Int(i8::from_le_bytes(self.nth(base, i)?).into()),
            Elem::Bool => match self.nth::<1>(base, i)? {
                [0] => Scalar::Bool(false),
                [1] => Scalar::Bool(true),
                _ => return None,
            },
        })
    }

    /// The `N` bytes of the `i`th of `N`-byte elements starting at `base`, if they are
    /// inside the records.
    #[inline(always)]
    fn nth<const N: usize>(&self, base: usize, i: usize) -> Option<[u8; N]> {
        self.fixed(i.checked_mul(N)?.checked_add(base)?)
    }

    /// The `N` bytes at `at`, if they are inside the records.
    #[inline(always)]
    fn fixed<const N: usize>(&self, at: usize) -> Option<[u8; N]> {
        let end = at.checked_add(N)?;
        if end > self.rec_end {
            return None;
        }
        self.bytes().get(at..end)?.try_into().ok()
    }

    #[inline(always)]
    pub(super) fn scalar(&self, elem: Elem, at: usize) -> Result<Item<'_>, ArchiveError> {
        match read_elem(elem, self.get(at, elem.size())?) {
            Some(s) => Ok(s.into()),
            None => corrupt("a packed bool is not 0 or 1"),
        }
    }

    // --- dicts --------------------------------------------------------------------------

    /// Number of entries of a dict node.
    pub fn dict_len(&self, node: Node) -> Result<usize, ArchiveError> {
        match node.form {
            Form::Struct(id) => Ok(self.shape(id as u64)?.shape.keys.len()),
            Form::Tagged if self.byte(node.pos as usize)? == T_DICT => {
                Ok(self.count(node.pos as usize + 1, 2 * REF)?.0)
            }
            _ => corrupt("not a dict"),
        }
    }

    /// The key symbols of a shaped dict node (`None` for the general layout).
    #[inline]
    pub fn dict_shape_keys(&self, node: Node) -> Option<&[u32]> {
        match node.form {
            Form::Struct(id) => self.shapes.get(id as usize).map(|s| &s.shape.keys[..]),
            _ => None,
        }
    }

    /// The shape id of a shaped dict node (`None` for any other node).
    #[inline(always)]
    pub fn dict_shape(&self, node: Node) -> Option<u32> {
        match node.form {
            Form::Struct(id) => Some(id),
            _ => None,
        }
    }

    /// The number of shapes, and shape `id` (its keys, slot encodings and offsets).
    pub fn shape_count(&self) -> usize {
        self.shapes.len()
    }

    pub fn shape_def(&self, id: u32) -> Option<&Shape> {
        self.shapes.get(id as usize).map(|s| &s.shape)
    }

    /// The value in the slot of a shaped dict node that a field of its shape (`enc` at
    /// `off`, from [`Self::shape_def`]) names: what `dict_value` reads, for a caller that
    /// found the field itself.
    #[inline(always)]
    pub fn struct_slot(&self, node: Node, enc: Enc, off: u32) -> Result<Item<'_>, ArchiveError> {
        let at = (node.pos as usize)
            .checked_add(off as usize)
            .ok_or_else(|| ArchiveError::Corrupt("a slot beyond the address space".into()))?;
        self.slot(node.rec, enc, at)
    }

    /// [`Self::struct_slot`] for the smallest read path (`DictView`'s `view["field"]`): the
    /// slot's value for the encodings that path makes at once (None, bool, int, float, str,
    /// a packed list or tuple), or `None` for the others (bytes, a reference to a tagged
    /// value) and wherever `struct_slot` gives an error; the caller then takes the long way,
    /// which reads (or raises) it. Makes no error value, so it stays small where inlined.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))] // the stable-ABI wheel keeps pyo3's slots
    pub fn struct_slot_small(&self, node: Node, enc: Enc, off: u32) -> Option<Item<'_>> {
        let at = usize::try_from(node.pos).ok()?.checked_add(off as usize)?;
        Some(match enc {
            Enc::None => Item::None,
            Enc::Bool => self.elem_at(Elem::Bool, at, 0)?.into(),
            Enc::Int(e @ (Elem::I8 | Elem::I16 | Elem::I32 | Elem::I64)) => {
                self.elem_at(e, at, 0)?.into()
            }
            Enc::F64 => self.elem_at(Elem::F64, at, 0)?.into(),
            Enc::Str => {
                // As `follow`, `count` and `get` read it (`slot`), without their errors.
                let t = self.follow_small(at)?;
                let (n, after) = get_varint_small(self.bytes().get(..self.rec_end)?, t)?;
                let end = usize::try_from(n).ok()?.checked_add(after)?;
                if end > self.rec_end {
                    return None;
                }
                Item::Str(self.bytes().get(after..end)?)
            }
            Enc::Pack { elem, count, tuple } => pack_item(node.rec, elem, count, tuple, at),
            Enc::Int(Elem::Bool | Elem::F64) | Enc::Bytes | Enc::Ref => return None,
        })
    }

    /// A reference slot of a shaped dict whose value is a list or tuple of shaped dicts
    /// (COCO's annotations), of fewer than 128 and with a shape id below 128: its node and
    /// layout, as `slot` and then `seq` read them, without their error values (for the
    /// smallest read path, as `struct_slot_small`); `None` for anything else.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub fn struct_slot_seq_small(&self, node: Node, off: u32) -> Option<(Node, SeqAt)> {
        let at = usize::try_from(node.pos).ok()?.checked_add(off as usize)?;
        let t = self.follow_small(at)?;
        // The tag, the shape id and the count, each varint of one byte.
        let [tag, id, n] = self.fixed::<3>(t)?;
        if !matches!(tag, T_LIST_STRUCT | T_TUPLE_STRUCT) || id >= 0x80 || n >= 0x80 {
            return None;
        }
        let step = self.shapes.get(usize::from(id))?.shape.size as usize;
        let first = t + 3;
        if usize::from(n).checked_mul(step)?.checked_add(first)? > self.rec_end {
            return None;
        }
        let seq = SeqAt {
            rec: node.rec,
            shape: u32::from(id),
            kind: SeqKind::Struct,
            elem: Elem::I8,
            step,
            len: usize::from(n),
            at: first,
        };
        let list = Node {
            rec: node.rec,
            form: Form::Tagged,
            pos: t as u64,
        };
        Some((list, seq))
    }

    /// The target of the forward reference at `at`, as `follow` reads it, without its
    /// error values.
    #[inline(always)]
    pub(super) fn follow_small(&self, at: usize) -> Option<usize> {
        let d = u32::from_le_bytes(self.fixed::<REF>(at)?) as usize;
        let t = at.checked_add(d)?;
        (d != 0 && t < self.rec_end).then_some(t)
    }

    /// Value of entry `i` of a dict node.
    #[inline(always)]
    pub fn dict_value(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Struct(id) => {
                let sh = &self.shape(id as u64)?.shape;
                let (Some(&enc), Some(&off)) = (sh.encs.get(i), sh.offsets.get(i)) else {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                };
                self.slot(node.rec, enc, node.pos as usize + off as usize)
            }
            _ => {
                let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
                if i >= n {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                }
                self.tagged(node.rec, self.follow(at + (2 * i + 1) * REF)?)
            }
        }
    }

    /// Key of entry `i` of a dict node.
    pub fn dict_key(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Struct(id) => match self.shape(id as u64)?.shape.keys.get(i) {
                Some(&k) => Ok(Item::Sym(k)),
                None => Err(ArchiveError::Invalid(format!("entry {i} out of range"))),
            },
            _ => {
                let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
                if i >= n {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                }
                self.tagged(node.rec, self.follow(at + 2 * i * REF)?)
            }
        }
    }

    /// A typed slot's value.
    #[inline(always)]
    pub(super) fn slot(&self, rec: u32, enc: Enc, at: usize) -> Result<Item<'_>, ArchiveError> {
        Ok(match enc {
            Enc::None => Item::None,
            Enc::Bool => match self.byte(at)? {
                0 => Item::Bool(false),
                1 => Item::Bool(true),
                _ => return corrupt("a bool slot is not 0 or 1"),
            },
            Enc::Int(e) => self.scalar(e, at)?,
            Enc::F64 => Item::Float(f64::from_bits(self.u64(at)?)),
            Enc::Str | Enc::Bytes => {
                let t = self.follow(at)?;
                let (n, after) = self.count(t, 1)?;
                let b = self.get(after, n)?;
                if enc == Enc::Str {
                    Item::Str(b)
                } else {
                    Item::Bytes(b)
                }
            }
            Enc::Pack { elem, count, tuple } => pack_item(rec, elem, count, tuple, at),
            Enc::Ref => self.tagged(rec, self.follow(at)?)?,
        })
    }

    /// Entry number of the str `key` in a dict node.
    pub fn dict_find_str(&self, node: Node, key: &str) -> Result<Option<usize>, ArchiveError> {
        if let Form::Struct(id) = node.form {
            let keys = &self.shape(id as u64)?.shape.keys;
            for (i, &k) in keys.iter().enumerate() {
                if self.symbol(k)? == key {
                    return Ok(Some(i));
                }
            }
            return Ok(None);
        }
        let hash = crate::archive::key::hash_str(key);
        self.general_find(node, hash, |k| {
            Ok(match k {
                Item::Sym(id) => self.symbol(id)? == key,
                Item::Str(s) => s == key.as_bytes(),
                _ => false,
            })
        })
    }

    /// Entry number of `key` in a dict node.
    pub fn dict_find(&self, node: Node, key: &Key<'_>) -> Result<Option<usize>, ArchiveError> {
        if let Key::Str(s) = key {
            return self.dict_find_str(node, s);
        }
        if let Form::Struct(_) = node.form {
            return Ok(None); // shaped dicts have str keys only
        }
        self.general_find(node, key.stable_hash(), |k| {
            Ok(self.item_key(k)?.key_eq(key))
        })
    }

    /// Whether a general dict node has a hash index.
    pub fn dict_indexed(&self, node: Node) -> bool {
        node.form == Form::Tagged
            && self
                .dict_len(node)
                .is_ok_and(crate::archive::value::dict_has_index)
    }

    pub(super) fn general_find(
        &self,
        node: Node,
        hash: u64,
        mut matches: impl FnMut(Item<'_>) -> Result<bool, ArchiveError>,
    ) -> Result<Option<usize>, ArchiveError> {
        let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
        let key = |e: usize| self.tagged(node.rec, self.follow(at + 2 * e * REF)?);
        if !crate::archive::value::dict_has_index(n) {
            for e in 0..n {
                if matches(key(e)?)? {
                    return Ok(Some(e));
                }
            }
            return Ok(None);
        }
        let cap = table::record_index_capacity(n);
        let idx = self.get(at + 2 * n * REF, cap * 4)?;
        let mut i = table::home(hash, cap as u64) as usize;
        for _ in 0..cap {
            let e = u32_at(idx, i * 4) as usize;
            if e == 0 {
                return Ok(None);
            }
            if e > n {
                return corrupt("dict index out of range");
            }
            if matches(key(e - 1)?)? {
                return Ok(Some(e - 1));
            }
            i = table::next(i, cap);
        }
        Ok(None)
    }

    // --- out-of-line data ---------------------------------------------------------------

    /// The bytes of an out-of-line payload (in the records region, 64-byte aligned).
    pub fn payload(&self, ext: Extent) -> Result<&[u8], ArchiveError> {
        let ok = usize::try_from(ext.offset)
            .ok()
            .zip(usize::try_from(ext.len).ok());
        match ok {
            Some((o, l))
                if o >= HEADER_LEN
                    && o % PAYLOAD_ALIGN as usize == 0
                    && o.checked_add(l).is_some_and(|e| e <= self.rec_end) =>
            {
                Ok(&self.bytes()[o..o + l])
            }
            _ => corrupt("out-of-line data out of bounds"),
        }
    }

    /// The bytes of an out-of-line `bytes` value, checked against their checksum: reading
    /// them copies them anyway, so the hash costs little next to the copy (array data, which
    /// is mapped and not copied, is checked by [`Self::validate_all`] only).
    pub fn payload_checked(&self, ext: Extent) -> Result<&[u8], ArchiveError> {
        let data = self.payload(ext)?;
        if xxh3_64(data) != ext.checksum {
            return corrupt(format!(
                "the out-of-line data at {} ({} bytes) was modified",
                ext.offset, ext.len
            ));
        }
        Ok(data)
    }

    /// Where an array's data is, and its checksum (its metadata's last 24 bytes), unchecked
    /// against the metadata ([`Self::array`] checks).
    pub fn array_extent(&self, a: ArrayAt) -> Result<Extent, ArchiveError> {
        self.ext_at(self.array_meta_end(a.pos as usize)? - 24)
    }

    /// Check an array's metadata against its data and return where it lives.
    pub fn array(&self, a: ArrayAt) -> Result<ArrayView, ArchiveError> {
        let at = a.pos as usize;
        let rec = a.rec;
        let end = self.array_meta_end(at)?;
        let tl = self.byte(at)? as usize;
        let typestr = std::str::from_utf8(self.get(at + 1, tl)?)
            .map_err(|_| ArchiveError::Corrupt(format!("record {rec}: array dtype not UTF-8")))?;
        let Some((typestr, itemsize)) = TypeStr::new(typestr) else {
            return corrupt(format!("array with unsupported dtype {typestr:?}"));
        };
        let nd = self.byte(at + 1 + tl)? as usize;
        if nd > MAX_NDIM {
            return corrupt(format!(
                "record {rec}: array with {nd} dimensions (at most {MAX_NDIM})"
            ));
        }
        let dims = at + 2 + tl;
        let shape = (0..nd)
            .map(|i| Ok(self.u64(dims + i * 8)? as usize))
            .collect::<Result<Vec<usize>, ArchiveError>>()?;
        // numpy's own rule (it skips zero dimensions): the product of the other dimensions
        // times the item size must fit in an isize, else it refuses the array. An empty
        // array of shape (0, 2**62) holds no data but is still no array numpy can make.
        let too_big = || ArchiveError::Corrupt(format!("record {rec}: array shape overflows"));
        let span = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or_else(too_big)?;
        let n = if shape.contains(&0) { 0 } else { span };
        let ext = self.ext_at(end - 24)?;
        let data = self.payload(ext)?;
        if n != data.len() {
            return corrupt(format!("record {rec}: array metadata inconsistent"));
        }
        let offset = ext.offset as usize;
        Ok(ArrayView {
            typestr,
            shape,
            offset,
            nbytes: n,
        })
    }
}

/// The item of a packed slot (`count` elements of `elem` inline at `at` of record `rec`): a
/// list or tuple whose node's form says how to read it.
#[inline(always)]
fn pack_item<'a>(rec: u32, elem: Elem, count: u8, tuple: bool, at: usize) -> Item<'a> {
    let node = Node {
        rec,
        form: Form::Pack { elem, count, tuple },
        pos: at as u64,
    };
    if tuple {
        Item::Tuple(node)
    } else {
        Item::List(node)
    }
}
