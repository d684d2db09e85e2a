//! The line protocol between clients and the supervisor. One request per line, one reply
//! line each (`LIST` replies with `SEG` lines and `END`). Paths are absolute and contain no
//! newline (segment names are checked; saved files are not registered).
//!
//! ```text
//! HELLO <pid>            -> OK <supervisor pid>
//! USE <path>             -> OK           this client uses the segment at <path>
//! DROP <path>            -> OK           ... no longer
//! LIST                   -> SEG <path> <pid>,<pid>...  (one per segment)  then END
//! ```

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello(u32),
    Use(PathBuf),
    Drop(PathBuf),
    List,
}

impl Request {
    pub fn parse(line: &str) -> Option<Request> {
        let (cmd, arg) = line.split_once(' ').unwrap_or((line, ""));
        match cmd {
            "HELLO" => arg.parse().ok().map(Request::Hello),
            "USE" if arg.starts_with('/') => Some(Request::Use(PathBuf::from(arg))),
            "DROP" if arg.starts_with('/') => Some(Request::Drop(PathBuf::from(arg))),
            "LIST" => Some(Request::List),
            _ => None,
        }
    }

    pub fn encode(&self) -> String {
        match self {
            Request::Hello(pid) => format!("HELLO {pid}\n"),
            Request::Use(p) => format!("USE {}\n", p.display()),
            Request::Drop(p) => format!("DROP {}\n", p.display()),
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

pub fn encode_seg(path: &Path, pids: &[u32]) -> String {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    format!("SEG {} {}\n", path.display(), pids.join(","))
}

pub fn parse_seg(line: &str) -> Option<SegmentUse> {
    let rest = line.strip_prefix("SEG ")?;
    let (path, pids) = rest.rsplit_once(' ')?;
    Some(SegmentUse {
        path: PathBuf::from(path),
        pids: pids.split(',').filter_map(|p| p.parse().ok()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        for r in [
            Request::Hello(42),
            Request::Use("/dev/shm/shmstore-a".into()),
            Request::Drop("/dev/shm/shmstore-b".into()),
            Request::List,
        ] {
            assert_eq!(Request::parse(r.encode().trim_end()), Some(r));
        }
        assert_eq!(Request::parse("USE relative"), None);
        assert_eq!(Request::parse("NOPE"), None);
        let s = encode_seg(Path::new("/dev/shm/shmstore-x"), &[1, 2]);
        assert_eq!(
            parse_seg(s.trim_end()),
            Some(SegmentUse {
                path: "/dev/shm/shmstore-x".into(),
                pids: vec![1, 2]
            })
        );
    }
}
