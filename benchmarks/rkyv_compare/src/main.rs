//! Encodes records read as JSON lines (stdin) with rkyv, as shmstore's archive formats 1-3 did
//! (`Value` below is their value model, reduced to the variants JSON can produce), and prints
//! the sizes as one JSON object on stdout.
//!
//! Each record is one rkyv buffer (`rkyv::to_bytes`), as each record was one span of a
//! format-3 archive; dict keys are interned (`Sym`, an index into one table of key strings per
//! archive), as they were. The figure printed is the rkyv bytes of the records plus the key
//! table; a format-3 archive added a header, an offsets table and a checksum per record.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};

use rkyv::{Archive, Serialize};

/// One stored value: the variants of formats 1-3 that JSON values map to. An archived `Value`
/// is a 1-byte tag and 8 bytes (rkyv's `unaligned` format, 32-bit relative pointers).
#[derive(Archive, Serialize, Debug)]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext, __C::Error: rkyv::rancor::Source)))]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// A str interned in the archive's key table (dict keys).
    Sym(u32),
    List(#[rkyv(omit_bounds)] Vec<Value>),
    /// Keys and values interleaved (`k0, v0, k1, v1, ...`), in insertion order.
    Dict(#[rkyv(omit_bounds)] Vec<Value>),
}

#[derive(Default)]
struct Keys {
    index: HashMap<String, u32>,
    bytes: usize,
}

impl Keys {
    fn sym(&mut self, key: &str) -> u32 {
        if let Some(&i) = self.index.get(key) {
            return i;
        }
        let i = u32::try_from(self.index.len()).expect("fewer than 2**32 keys");
        self.bytes += key.len() + 8; // the string and its (offset, length) entry
        self.index.insert(key.to_owned(), i);
        i
    }
}

fn convert(v: &serde_json::Value, keys: &mut Keys) -> Value {
    match v {
        serde_json::Value::Null => Value::None,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => Value::Float(n.as_f64().expect("a JSON number is an i64 or an f64")),
        },
        serde_json::Value::String(s) => Value::Str(s.clone()),
        serde_json::Value::Array(items) => {
            Value::List(items.iter().map(|x| convert(x, keys)).collect())
        }
        serde_json::Value::Object(map) => {
            let mut items = Vec::with_capacity(2 * map.len());
            for (k, x) in map {
                items.push(Value::Sym(keys.sym(k)));
                items.push(convert(x, keys));
            }
            Value::Dict(items)
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut keys = Keys::default();
    let (mut records, mut rkyv_bytes, mut json_bytes) = (0usize, 0usize, 0usize);
    for line in io::stdin().lock().lines() {
        let line = line?;
        if line.is_empty() {
            continue;
        }
        json_bytes += line.len();
        let value = convert(&serde_json::from_str(&line)?, &mut keys);
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&value)?;
        // What formats 1-3 did on first access: validate the bytes, then read in place.
        rkyv::access::<ArchivedValue, rkyv::rancor::Error>(&bytes)?;
        rkyv_bytes += bytes.len();
        records += 1;
    }
    let out = format!(
        "{{\"records\": {records}, \"rkyv_record_bytes\": {rkyv_bytes}, \
         \"key_table_bytes\": {}, \"json_bytes\": {json_bytes}, \
         \"archived_value_size\": {}}}",
        keys.bytes,
        std::mem::size_of::<ArchivedValue>()
    );
    writeln!(io::stdout(), "{out}")?;
    Ok(())
}
