//! What a store needs to travel to another machine (`shmstore.cluster`): its content
//! digest, a cheap identity to recognise a copy, and making a local copy from archive
//! bytes fetched elsewhere (verified against the digest before it gets its name).

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyDict;
use xxhash_rust::xxh3::Xxh3Default;

use super::errors::Error;
use super::handles::StoreHandle;
use super::pickle::rebuild;
use super::store::{self, Store};

/// xxh3-128 of every byte of the archive, as 32 hex digits.
fn hex128(v: u128) -> String {
    format!("{v:032x}")
}

/// Digests already computed in this process, by (path, header checksum, length): a
/// sealed archive never changes, so each is hashed at most once per process. Computed on
/// first need (sharing a store past its machine, `shmstore inspect`), not when sealing:
/// single-machine builds pay nothing for it (about 0.1-0.3 s per GiB when they do).
type DigestCache = Mutex<HashMap<(PathBuf, u64, u64), u128>>;

fn digests() -> &'static DigestCache {
    static D: OnceLock<DigestCache> = OnceLock::new();
    D.get_or_init(Default::default)
}

fn digest_of(py: Python<'_>, store: &Store) -> u128 {
    let h = store.reader.header();
    let key = (store.source.path().to_owned(), h.checksum, h.total_len);
    if let Some(d) = digests()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
    {
        return *d;
    }
    let bytes = store.reader.bytes();
    let d = py.detach(|| xxhash_rust::xxh3::xxh3_128(bytes));
    digests()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, d);
    d
}

/// Identity of a store for `shmstore.cluster`: kind, size, header checksum (O(1), what an
/// attach compares) and the content digest (xxh3-128 of the whole archive, computed once
/// per process with the GIL released; what a fetched copy is verified against).
#[pyfunction]
pub(crate) fn _cluster_identity<'py>(
    py: Python<'py>,
    handle: &Bound<'py, StoreHandle>,
    with_digest: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let store = StoreHandle::store(handle)?;
    let h = store.reader.header();
    let d = PyDict::new(py);
    d.set_item("name", store.source.name())?;
    d.set_item("path", store.source.path().display().to_string())?;
    d.set_item("kind", h.kind.name())?;
    d.set_item("nbytes", h.total_len)?;
    d.set_item("checksum", format!("{:016x}", h.checksum))?;
    if with_digest {
        d.set_item("digest", hex128(digest_of(py, &store)))?;
    }
    let fetched = std::fs::metadata(store.source.path())
        .map(|m| m.permissions().mode() & 0o100 != 0)
        .unwrap_or(false);
    d.set_item("fetched", fetched)?;
    Ok(d)
}

/// Make the segment `name` in `dir` from `chunks` (an iterable of bytes objects: the
/// archive, in order), check that it is exactly `nbytes` long with xxh3-128 `digest`, seal
/// it as a fetched copy and publish it. Returns the handle (of class `cls`). On any error
/// (a source failing midway, a wrong length or digest, no room) nothing is left behind.
#[pyfunction]
pub(crate) fn _import_archive<'py>(
    py: Python<'py>,
    cls: &str,
    name: &str,
    dir: PathBuf,
    nbytes: u64,
    digest: &str,
    chunks: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let want = u128::from_str_radix(digest, 16)
        .ok()
        .filter(|_| digest.len() == 32)
        .ok_or_else(|| Error::Invalid {
            at: format!("digest {digest:?}"),
            what: "not 32 hex digits".into(),
        })?;
    let origin = format!("fetching store {name:?}");
    let corrupt = |what: String| -> PyErr {
        Error::Corrupt {
            at: origin.clone(),
            what,
        }
        .into()
    };
    let store = store::import(py, name, &dir, |writer| {
        let mut hasher = Xxh3Default::new();
        let mut got: u64 = 0;
        for chunk in chunks.try_iter()? {
            let chunk: PyBackedBytes = chunk?.extract().map_err(|_| Error::Invalid {
                at: origin.clone(),
                what: "a source yielded something not bytes".into(),
            })?;
            got = got
                .checked_add(chunk.len() as u64)
                .filter(|g| *g <= nbytes)
                .ok_or_else(|| {
                    corrupt(format!(
                        "the source sent more than the {nbytes} bytes of the archive"
                    ))
                })?;
            py.detach(|| {
                hasher.update(&chunk);
                writer.write_all(&chunk)
            })
            .map_err(|e| Error::Archive {
                at: origin.clone(),
                err: e.into(),
            })?;
        }
        if got != nbytes {
            return Err(corrupt(format!(
                "the source sent {got} bytes, the archive has {nbytes}"
            )));
        }
        let have = hasher.digest128();
        if have != want {
            return Err(corrupt(format!(
                "the bytes fetched have digest {} but the store's is {digest}; the source \
                 holds another version of the archive",
                hex128(have)
            )));
        }
        Ok(())
    })?;
    digests().lock().unwrap_or_else(|p| p.into_inner()).insert(
        (
            store.source.path().to_owned(),
            store.reader.header().checksum,
            nbytes,
        ),
        want,
    );
    // `store` keeps the segment registered while the handle is made from the cache.
    let handle = rebuild(py, cls, store.source.path().to_owned(), "s")?;
    drop(store);
    Ok(handle)
}
