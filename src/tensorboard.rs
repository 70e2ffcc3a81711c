//! TensorBoard event files, written by hand: scalars only, so the format is small enough to own
//! instead of pulling in a protobuf stack.
//!
//! An event file (`events.out.tfevents.*`; TensorBoard reads every file with `tfevents` in its
//! name, in name order) is a sequence of TFRecords:
//! ```text
//! u64 length (little endian) | u32 masked crc32c(length bytes) | data | u32 masked crc32c(data)
//! ```
//! where `masked(c) = rotate_right(c, 15) + 0xa282ead8` (wrapping) and crc32c is the Castagnoli
//! CRC (reflected polynomial 0x82f63b78, init and final xor 0xffffffff). Each record's data is one
//! `tensorboard.Event` protobuf; the fields written here (tensorboard/compat/proto/event.proto and
//! summary.proto):
//! ```text
//! Event      { double wall_time = 1; int64 step = 2; string file_version = 3;
//!              Summary summary = 5; SessionLog session_log = 7; }
//! Summary    { repeated Value value = 1; }
//! Value      { string tag = 1; float simple_value = 2; }
//! SessionLog { SessionStatus status = 1; }   // START = 1
//! ```
//! The first event of a file carries `file_version = "brain.Event:2"`; with version 2 TensorBoard
//! handles restarts through `SessionLog.START` (see [`EventWriter::session_start`]).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Errors of the event-file writer and reader.
#[derive(Debug, thiserror::Error)]
pub enum TensorBoardError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("event file record {index}: {what}")]
    Corrupt { index: usize, what: String },
}

type Result<T, E = TensorBoardError> = std::result::Result<T, E>;

/// The `file_version` TensorBoard needs to apply `SessionLog.START` purges.
pub const FILE_VERSION: &str = "brain.Event:2";
/// Every event file's name starts so (TensorBoard matches `tfevents`).
pub const FILE_PREFIX: &str = "events.out.tfevents.";
/// `SessionLog.SessionStatus.START`.
const SESSION_START: u64 = 1;

/// CRC-32C (Castagnoli), table driven; the table is built at compile time.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The TFRecord checksum: crc32c rotated and offset, so that a CRC of data that itself holds
/// CRCs does not degenerate.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
pub fn encode_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// The records of an event file, each checked against both checksums. A torn last record (a
/// writer killed mid-write) ends the list, as in TensorBoard's own reader.
pub fn read_records(bytes: &[u8]) -> Result<Vec<&[u8]>> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while bytes.len() - at >= 12 {
        let index = out.len();
        let corrupt = |what: String| TensorBoardError::Corrupt { index, what };
        let len_bytes = &bytes[at..at + 8];
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        if crc != masked_crc32c(len_bytes) {
            return Err(corrupt("length checksum mismatch".into()));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        let len = usize::try_from(len).map_err(|_| corrupt(format!("length {len} does not fit in memory")))?;
        let start = at + 12;
        let Some(end) = start.checked_add(len).filter(|e| e.checked_add(4).is_some_and(|x| x <= bytes.len())) else {
            break; // torn last record
        };
        let data = &bytes[start..end];
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        if crc != masked_crc32c(data) {
            return Err(corrupt("data checksum mismatch".into()));
        }
        out.push(data);
        at = end + 4;
    }
    Ok(out)
}

// Protobuf encoding (the wire format's three types used here): a field key is the varint
// `field << 3 | wire type`; wire type 0 = varint, 1 = 64-bit, 2 = length-delimited, 5 = 32-bit.

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, field << 3 | wire);
}

fn bytes_field(out: &mut Vec<u8>, field: u64, data: &[u8]) {
    key(out, field, 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// An `Event` with its wall time and step, and `what` (already encoded fields) appended.
fn event(wall_time: f64, step: i64, what: &[u8]) -> Vec<u8> {
    let mut e = Vec::with_capacity(what.len() + 24);
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(&mut e, 2, 0);
    varint(&mut e, step as u64); // int64: negative values are ten-byte two's complement varints
    e.extend_from_slice(what);
    e
}

/// A `Summary` of scalars (`simple_value`), as Event field 5.
fn summary_field(values: &[(&str, f32)]) -> Vec<u8> {
    let mut s = Vec::new();
    for (tag, v) in values {
        let mut val = Vec::with_capacity(tag.len() + 8);
        bytes_field(&mut val, 1, tag.as_bytes());
        key(&mut val, 2, 5);
        val.extend_from_slice(&v.to_le_bytes());
        bytes_field(&mut s, 1, &val);
    }
    let mut out = Vec::with_capacity(s.len() + 4);
    bytes_field(&mut out, 5, &s);
    out
}

/// Seconds since the Unix epoch (what TensorBoard's wall time is).
pub fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Appends events to one new event file. Each event goes out in one write call and is not
/// buffered, so TensorBoard sees every step as soon as it is written and a kill tears at most
/// the last record (which readers skip).
#[derive(Debug)]
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it whose name sorts after every event file
    /// already there: TensorBoard reads a folder's files in name order, and a resumed run's
    /// `SessionLog.START` must come after the events it supersedes. The name's timestamp is the
    /// current second, or one past the newest existing file's when that is not later (a run
    /// stopped and resumed within a second).
    pub fn create(dir: &Path) -> Result<Self> {
        let io = |path: &Path, op: &'static str| {
            let path = path.to_path_buf();
            move |source| TensorBoardError::Io { path, op, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir, "create the folder"))?;
        let newest = existing_event_files(dir)?
            .iter()
            .filter_map(|p| p.file_name()?.to_str()?.strip_prefix(FILE_PREFIX)?.split('.').next()?.parse::<u64>().ok())
            .max();
        let now = unix_seconds() as u64;
        let secs = newest.map_or(now, |n| now.max(n + 1));
        let host = hostname();
        let path = dir.join(format!("{FILE_PREFIX}{secs:010}.{host}.{}", std::process::id()));
        let file = File::options().create_new(true).append(true).open(&path).map_err(io(&path, "create"))?;
        let mut w = EventWriter { file, path };
        let mut version = Vec::new();
        bytes_field(&mut version, 3, FILE_VERSION.as_bytes());
        w.write_event(&event(unix_seconds(), 0, &version))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Marks a (re)start at `step`: TensorBoard then drops every event it read before with a
    /// step >= `step` (`_CheckForRestartAndMaybePurge` in its event accumulator), so the steps a
    /// killed run logged past its last checkpoint give way to the resumed run's. Readers that
    /// ignore `SessionLog` keep both copies of those steps; the resumed run's are the ones in
    /// the newer file, with the later wall times.
    pub fn session_start(&mut self, step: i64, wall_time: f64) -> Result<()> {
        let mut log = Vec::new();
        key(&mut log, 1, 0);
        varint(&mut log, SESSION_START);
        let mut what = Vec::new();
        bytes_field(&mut what, 7, &log);
        self.write_event(&event(wall_time, step, &what))
    }

    /// One event holding every scalar of a step.
    pub fn scalars(&mut self, step: i64, wall_time: f64, values: &[(&str, f32)]) -> Result<()> {
        self.write_event(&event(wall_time, step, &summary_field(values)))
    }

    fn write_event(&mut self, data: &[u8]) -> Result<()> {
        // One write of the whole record: a torn file ends in a partial record, never a gap.
        self.file.write_all(&encode_record(data)).map_err(|source| TensorBoardError::Io {
            path: self.path.clone(),
            op: "write",
            source,
        })
    }
}

/// The event files in `dir`, in name order (TensorBoard's reading order).
pub fn existing_event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TensorBoardError::Io { path: dir.to_path_buf(), op: "list", source }),
    };
    let mut out: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(FILE_PREFIX)))
        .collect();
    out.sort();
    Ok(out)
}

/// This machine's name for event file names (TensorBoard's convention), dots and slashes removed
/// so the name stays one path component with a parseable timestamp.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let h: String = raw.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_').collect();
    if h.is_empty() {
        "localhost".into()
    } else {
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard CRC-32C check value, and the known value of 32 zero bytes (RFC 3720 B.4).
    #[test]
    fn crc32c_matches_the_published_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    }

    #[test]
    fn varints_encode_as_protobuf_does() {
        let enc = |v: u64| {
            let mut o = Vec::new();
            varint(&mut o, v);
            o
        };
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(-1i64 as u64).len(), 10);
    }

    #[test]
    fn a_torn_last_record_ends_the_list_and_a_flipped_byte_is_caught() {
        let mut bytes = encode_record(b"first");
        bytes.extend(encode_record(b"second"));
        let full = bytes.len();
        assert_eq!(read_records(&bytes).unwrap(), vec![&b"first"[..], &b"second"[..]]);
        assert_eq!(read_records(&bytes[..full - 3]).unwrap(), vec![&b"first"[..]]);
        bytes[14] ^= 1;
        assert!(matches!(read_records(&bytes), Err(TensorBoardError::Corrupt { index: 0, .. })));
    }
}
