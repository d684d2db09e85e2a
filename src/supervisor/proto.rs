//! The line protocol between clients and the supervisor. One request per line, one reply
//! line each (`LIST` replies with `SEG` lines and `END <count>`). Paths are absolute and
//! contain no newline (segment names are checked).
//!
//! ```text
//! HELLO <pid>            -> OK <supervisor pid>
//! NEW <path>             -> OK           this client creates a segment at <path> (its
//!                                        directory becomes a segment directory)
//! USE <path>             -> OK           this client uses (attached) the file at <path>
//! DROP <path>            -> OK           ... no longer
//! DROP <path>\0<path>... -> OK           ... none of these (one line, one settling: a path
//!                                        never contains NUL)
//! PIN <holder>\0<path>   -> OK           keep <path> while the segment <holder> is in use
//!                                        (both in the same segment directory; see the
//!                                        supervisor's `handle`); `ERR <why>` if refused
//! LIST                   -> SEG <path> <pid>,<pid>...  (one per segment)  then END <count>
//! ```
//!
//! A client may send many requests before reading their replies (DROPs are sent in
//! batches); replies come in order. The count after `END` lets a reader tell a complete
//! listing from a cut one.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello(u32),
    New(PathBuf),
    Use(PathBuf),
    Drop(PathBuf),
    /// Many DROPs in one line (settled together by the supervisor).
    DropMany(Vec<PathBuf>),
    /// Keep `path` while the segment `holder` is in use (docs/lifecycle.md, "Pins").
    Pin {
        holder: PathBuf,
        path: PathBuf,
    },
    List,
}

impl Request {
    pub fn parse(line: &str) -> Option<Request> {
        let (cmd, arg) = line.split_once(' ').unwrap_or((line, ""));
        let path = || (arg.starts_with('/') && !arg.contains('\0')).then(|| PathBuf::from(arg));
        match cmd {
            "HELLO" => arg.parse().ok().map(Request::Hello),
            "NEW" => path().map(Request::New),
            "USE" => path().map(Request::Use),
            "DROP" if arg.contains('\0') => {
                let paths: Vec<PathBuf> = arg.split('\0').map(PathBuf::from).collect();
                paths
                    .iter()
                    .all(|p| p.is_absolute())
                    .then_some(Request::DropMany(paths))
            }
            "DROP" => path().map(Request::Drop),
            "PIN" => {
                let (holder, path) = arg.split_once('\0')?;
                let ok = |p: &str| p.starts_with('/') && !p.contains('\0');
                (ok(holder) && ok(path)).then(|| Request::Pin {
                    holder: PathBuf::from(holder),
                    path: PathBuf::from(path),
                })
            }
            "LIST" => Some(Request::List),
            _ => None,
        }
    }

    pub fn encode(&self) -> String {
        match self {
            Request::Hello(pid) => format!("HELLO {pid}\n"),
            Request::New(p) => format!("NEW {}\n", p.display()),
            Request::Use(p) => format!("USE {}\n", p.display()),
            Request::Drop(p) => format!("DROP {}\n", p.display()),
            Request::DropMany(ps) => {
                let ps: Vec<String> = ps.iter().map(|p| p.display().to_string()).collect();
                format!("DROP {}\n", ps.join("\0"))
            }
            Request::Pin { holder, path } => {
                format!("PIN {}\0{}\n", holder.display(), path.display())
            }
            Request::List => "LIST\n".into(),
        }
    }
}

/// One segment as the supervisor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentUse {
    pub path: PathBuf,
    /// Pids of the clients (and adopted processes) using it.
    pub pids: Vec<u32>,
}

/// A `SEG` line; a segment tracked without users of its own (kept only by a pin) has `-`
/// for its pids (an empty list would leave a trailing space, which a line reader trims).
pub fn encode_seg(path: &Path, pids: &[u32]) -> String {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let pids = if pids.is_empty() {
        "-".to_owned()
    } else {
        pids.join(",")
    };
    format!("SEG {} {pids}\n", path.display())
}

pub fn parse_seg(line: &str) -> Option<SegmentUse> {
    let rest = line.strip_prefix("SEG ")?;
    let (path, pids) = rest.rsplit_once(' ')?;
    Some(SegmentUse {
        path: PathBuf::from(path),
        pids: match pids {
            "-" => Vec::new(),
            pids => pids.split(',').filter_map(|p| p.parse().ok()).collect(),
        },
    })
}

/// The count in an `END <count>` line (None: not an END line).
pub fn parse_end(line: &str) -> Option<usize> {
    line.strip_prefix("END ")?.parse().ok()
}

/// Read one line, without its newline.
#[cfg(test)]
pub fn read_line(r: &mut impl std::io::BufRead) -> std::io::Result<String> {
    let mut s = String::new();
    if r.read_line(&mut s)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the supervisor closed the connection",
        ));
    }
    Ok(s.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        for r in [
            Request::Hello(42),
            Request::New("/dev/shm/shmstore-n".into()),
            Request::Use("/dev/shm/shmstore-a".into()),
            Request::Drop("/dev/shm/shmstore-b".into()),
            Request::DropMany(vec!["/dev/shm/shmstore-c".into(), "/x/shmstore-d".into()]),
            Request::Pin {
                holder: "/dev/shm/shmstore-chan".into(),
                path: "/dev/shm/shmstore-arena".into(),
            },
            Request::List,
        ] {
            assert_eq!(Request::parse(r.encode().trim_end()), Some(r));
        }
        assert_eq!(Request::parse("USE relative"), None);
        // PIN takes exactly two absolute paths.
        for bad in [
            "PIN",
            "PIN /dev/shm/shmstore-a",
            "PIN /dev/shm/shmstore-a\0",
            "PIN \0/dev/shm/shmstore-a",
            "PIN rel\0/dev/shm/shmstore-a",
            "PIN /dev/shm/shmstore-a\0rel",
            "PIN /a\0/b\0/c",
        ] {
            assert_eq!(Request::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Request::parse("NOPE"), None);
        let s = encode_seg(Path::new("/dev/shm/shmstore-x"), &[1, 2]);
        assert_eq!(
            parse_seg(s.trim_end()),
            Some(SegmentUse {
                path: "/dev/shm/shmstore-x".into(),
                pids: vec![1, 2]
            })
        );
        // Kept only by a pin: no users. The reply's line is read with its end trimmed.
        let s = encode_seg(Path::new("/dev/shm/shmstore-arena"), &[]);
        assert_eq!(
            parse_seg(s.trim_end()),
            Some(SegmentUse {
                path: "/dev/shm/shmstore-arena".into(),
                pids: vec![]
            })
        );
        assert_eq!(parse_end("END 3"), Some(3));
        assert_eq!(parse_end("END"), None);
    }
}
