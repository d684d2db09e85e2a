//! The supervising cleanup process and its client (issue: segment lifecycle). Not built yet:
//! until then a segment's name lives as long as its creator uses it (see docs/lifecycle.md).
