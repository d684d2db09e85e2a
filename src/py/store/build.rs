//! Building a new store (streaming into a segment, published under its name), importing
//! one fetched from elsewhere, and saving a store to a file.

use super::*;

/// Build a new store: `feed` writes the records into the builder; on any error (including
/// a Python exception raised by the input iterator) the partial segment is removed.
pub(crate) fn build(
    py: Python<'_>,
    kind: Kind,
    name: Option<&str>,
    dir: Option<PathBuf>,
    size_hint: Option<u64>,
    feed: impl FnOnce(&mut Builder<SegmentWriter>) -> PyResult<()>,
) -> PyResult<Arc<Store>> {
    let name = match name {
        Some(n) => segment::normalize_name(n).map_err(Error::from)?,
        None => segment::random_name(),
    };
    let (dir, fallback) = placement(dir, size_hint)?;
    let context = format!("store {name:?}");
    let archive_err = |err| Error::Archive {
        at: context.clone(),
        err,
    };
    // The supervisor knows the segment before anything of it exists (docs/invariants.md, 5),
    // so the death of this process at any point (even mid-build) is noticed and cleaned up.
    let (mut reg, writer) = Registration::created_then(py, dir.join(&name), || {
        SegmentWriter::create(&dir, &name, fallback.as_deref())
    });
    let writer = writer.map_err(Error::from)?;
    let mut builder = Builder::new(writer, kind, std::process::id()).map_err(archive_err)?;
    feed(&mut builder)?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let (writer, total) = builder.finish(now_ms).map_err(archive_err)?;
    // The writer may have moved to the fallback directory when the first one filled up.
    reg.follow(py, writer.final_path());
    let store = publish(py, writer, reg, name, &context, Sealed::Built)?;
    log::debug!(
        "created {} ({total} bytes, {} records)",
        store.source.name(),
        store.reader.len()
    );
    Ok(store)
}

/// How a segment is sealed: built in this machine (mode 0400) or a fetched copy of an
/// archive built elsewhere (0500: the owner-execute bit marks it for `shmstore ls`; nothing
/// maps a segment executable).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sealed {
    Built,
    Fetched,
}

impl Sealed {
    pub(super) fn mode(self) -> u32 {
        match self {
            Sealed::Built => 0o400,
            Sealed::Fetched => 0o500,
        }
    }
}

/// Seal and publish what `writer` holds, map it from the still-open descriptor and make
/// the `Store` (registered as `reg`). The file work is one stretch without the GIL (see
/// [`Registration::created_then`]).
pub(super) fn publish(
    py: Python<'_>,
    writer: SegmentWriter,
    mut reg: Registration,
    name: String,
    context: &str,
    sealed: Sealed,
) -> PyResult<Arc<Store>> {
    let published = py.detach(|| {
        let (path, file) = writer.publish_mode(sealed.mode())?;
        let opened = open_published(file, &path, &mut reg);
        if opened.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        Ok::<_, segment::SegmentError>((path, opened))
    });
    let (path, opened) = published.map_err(Error::from)?;
    let (reader, ident) = opened.map_err(|e| e.into_error(context))?; // `reg` drops the registration
    let store = Arc::new(Store {
        reader,
        source: Source::Segment { name, path },
        ident,
        py_symbols: PyOnceLock::new(),
        _lease: None,
        arena: None,
        registration: reg,
    });
    remember(&store);
    Ok(store)
}

/// Map the segment just published at `path` from its still-open descriptor `file` and open
/// its archive; without a supervisor (`reg` not active) this process owns the name and holds
/// the file's shared lock. With the file's identity (device, inode).
fn open_published(
    file: std::fs::File,
    path: &Path,
    reg: &mut Registration,
) -> Result<(Reader<Mapping>, (u64, u64)), StoreErr> {
    let mapping = Mapping::from_file(file, path, true).map_err(StoreErr::Segment)?;
    if !reg.active {
        // No supervisor: this process owns the name and removes it when done.
        mapping.take_ownership();
    }
    let ident = file_ident(path).unwrap_or((0, 0));
    reg.lock_if_unsupervised(ident).map_err(StoreErr::Segment)?;
    let reader = Reader::open(mapping).map_err(StoreErr::Archive)?;
    Ok((reader, ident))
}

/// Make a segment `name` in `dir` from archive bytes produced elsewhere (a copy fetched
/// from another machine): registered before its first byte exists, written by `feed`
/// into a private `.part` file (removed on any error), sealed as fetched and published
/// with `link()` (never over an existing name).
pub(crate) fn import(
    py: Python<'_>,
    name: &str,
    dir: &Path,
    feed: impl FnOnce(&mut SegmentWriter) -> PyResult<()>,
) -> PyResult<Arc<Store>> {
    let name = segment::normalize_name(name).map_err(Error::from)?;
    let context = format!("store {name:?}");
    let (reg, writer) = Registration::created_then(py, dir.join(&name), || {
        SegmentWriter::create(dir, &name, None)
    });
    let mut writer = writer.map_err(Error::from)?;
    feed(&mut writer)?;
    let store = publish(py, writer, reg, name, &context, Sealed::Fetched)?;
    log::debug!("fetched {} ({} bytes)", store.source.name(), store.nbytes());
    Ok(store)
}

/// Write the archive to a regular file, atomically and safely in shared directories
/// (`segment::save_file`), with permission bits `mode`.
pub(crate) fn save(py: Python<'_>, store: &Store, path: &Path, mode: u32) -> PyResult<()> {
    if mode & !0o777 != 0 {
        return Err(Error::Invalid {
            at: format!("mode {mode:#o}"),
            what: "only permission bits (0o000..0o777) can be given".into(),
        }
        .into());
    }
    let bytes = store.reader.bytes();
    py.detach(|| segment::save_file(bytes, path, mode))
        .map_err(Error::Save)?;
    Ok(())
}
