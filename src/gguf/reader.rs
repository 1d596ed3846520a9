//! GGUF reader over a memory map: header, metadata, tensor table, zero-copy tensor slices.
//! Every count, length, offset and size is checked against the file before it is used.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::value::{Value, ValueType};
use crate::error::{Error, Result};
use crate::quant::GgmlType;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are refused (no real file nests more than twice).
const MAX_ARRAY_DEPTH: u32 = 8;
/// Longest tensor name or metadata key accepted (ggml allows 64 bytes for names).
const MAX_NAME_LEN: u64 = 1 << 16;

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
    /// Number of rows (product of the other dimensions).
    pub fn n_rows(&self) -> usize {
        (self.n_elements / self.dims[0].max(1)) as usize
    }
    pub fn shape_string(&self) -> String {
        let d: Vec<String> = self.dims.iter().map(|d| d.to_string()).collect();
        format!("[{}]", d.join(", "))
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
    host_copies: bool,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: u64,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            msg: msg.into(),
        }
    }

    fn remaining(&self) -> u64 {
        self.buf.len() as u64 - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file has {} bytes",
                self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos as usize..(self.pos + n) as usize];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("take returned N bytes"))
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.err(format!(
                "{what}: string length {len} at offset {at} runs past the end of the file ({} bytes)",
                self.buf.len()
            )));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.err(format!("{what}: string at offset {at} is not valid UTF-8")))
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.u8(what)? as i8),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.u16(what)? as i16),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.u32(what)? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.u64(what)? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(what)?)),
            ValueType::Bool => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{what}: bool value {b} is neither 0 nor 1"))),
            },
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
                    )));
                }
                let at = self.pos;
                let tid = self.u32(what)?;
                let ety = ValueType::from_id(tid).ok_or_else(|| {
                    self.err(format!(
                        "{what}: unknown array element type {tid} at offset {at}"
                    ))
                })?;
                let n = self.u64(what)?;
                let need = n.checked_mul(ety.min_size());
                if need.is_none_or(|need| need > self.remaining()) {
                    return Err(self.err(format!(
                        "{what}: array of {n} {} elements at offset {at} cannot fit in the {} bytes left",
                        ety.name(),
                        self.remaining()
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(ety, what, depth + 1)?);
                }
                Value::Array(ety, items)
            }
        })
    }
}

/// How [`GgufFile::open`] holds a file's bytes ([`set_load`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load {
    /// Map the file (the default of every command that does not choose; `--mmap`).
    Map,
    /// Read the file into anonymous memory backed by huge pages (`--no-mmap`).
    Copy,
    /// Map the file; when it is at least [`AUTO_MIN_BYTES`] and takes at most half of the
    /// memory available (`MemAvailable`), the CPU copies the weights it runs into huge pages of
    /// its own ([`GgufFile::host_copies`]), so a weight the GPU holds is not copied: the default
    /// of `run`, `chat`, `serve`, `bench` and `perplexity`.
    Auto,
}

/// Files smaller than this are mapped under [`Load::Auto`]: their decode crosses few pages.
const AUTO_MIN_BYTES: u64 = 64 << 20;

static LOAD: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Sets how every later [`GgufFile::open`] holds the file. A copy in huge pages costs memory (the
/// page cache keeps its own copy, which the kernel may drop) and a slower start, and makes CPU
/// decode of large models faster: a weight read crosses a page, and a TLB entry, every 2 MiB
/// instead of every 4 KiB. LLaMA3-8B shape Q4_0, tg32, 2 EPYC threads, three alternated rounds:
/// mapped 6.02 / 5.61 / 5.02 t/s, copied 6.71 / 6.54 / 6.30, llama.cpp (which repacks Q4_0 into
/// its own memory) 6.38 / 7.10 / 6.02.
pub fn set_load(load: Load) {
    LOAD.store(load as u8, std::sync::atomic::Ordering::Relaxed);
}

fn load() -> Load {
    match LOAD.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Load::Copy,
        2 => Load::Auto,
        _ => Load::Map,
    }
}

/// Whether [`Load::Auto`] copies a file of `len` bytes, `available()` bytes of memory being
/// available (`None`: unknown, so no); asked only for a file big enough to copy.
fn auto_copies(len: u64, available: impl FnOnce() -> Option<u64>) -> bool {
    len >= AUTO_MIN_BYTES && available().is_some_and(|a| len <= a / 2)
}

/// `MemAvailable` in bytes (`None` where it cannot be read).
fn mem_available() -> Option<u64> {
    let free = crate::runtime::backend::MemInfo::host().free;
    (free > 0).then_some(free as u64)
}

/// The file's first `len` bytes read into anonymous memory that the kernel is asked to back with
/// transparent huge pages (2 MiB on x86-64): a weight read then crosses a page, and a TLB entry,
/// every 2 MiB instead of every 4 KiB, where the hardware prefetchers stop. `map` is the file's
/// map (what is copied where there is no `pread`).
fn copy_to_huge_pages(file: &std::fs::File, map: &Mmap, path: &Path) -> Result<Mmap> {
    let mut copy = memmap2::MmapMut::map_anon(map.len()).map_err(|e| Error::io(path, e))?;
    #[cfg(target_os = "linux")]
    if let Err(e) = copy.advise(memmap2::Advice::HugePage) {
        eprintln!(
            "oato: huge pages not available for {} ({e}); small pages",
            path.display()
        );
    }
    #[cfg(unix)]
    read_parallel(file, &mut copy).map_err(|e| Error::io(path, e))?;
    #[cfg(not(unix))]
    {
        let _ = file;
        copy.copy_from_slice(map);
    }
    copy.make_read_only().map_err(|e| Error::io(path, e))
}

/// Fills `dst` with the file's first `dst.len()` bytes, pieces of 64 MiB dealt round-robin to
/// several threads (reading, rather than copying from the map, spares a page fault per 4 KiB of
/// source).
#[cfg(unix)]
fn read_parallel(file: &std::fs::File, dst: &mut [u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const PIECE: usize = 64 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let mut dealt: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, piece) in dst.chunks_mut(PIECE).enumerate() {
        dealt[i % threads].push((i * PIECE, piece));
    }
    std::thread::scope(|s| {
        let workers: Vec<_> = dealt
            .into_iter()
            .map(|pieces| {
                s.spawn(move || {
                    pieces
                        .into_iter()
                        .try_for_each(|(at, piece)| file.read_exact_at(piece, at as u64))
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

impl GgufFile {
    /// Opens and validates `path`; tensor data stays in the memory map (or, as [`set_load`]
    /// asks, in a copy).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; oato never writes the file while it is open, and a file changed
        // by another process underneath is outside what any mmap-based reader can guard against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let len = mmap.len() as u64;
        match load() {
            Load::Map => Self::parse(path.to_path_buf(), mmap),
            Load::Copy => Self::parse(path.to_path_buf(), copy_to_huge_pages(&file, &mmap, path)?),
            Load::Auto => {
                let mut f = Self::parse(path.to_path_buf(), mmap)?;
                f.host_copies = auto_copies(len, mem_available);
                Ok(f)
            }
        }
    }

    /// Whether a backend that keeps weights in host memory should copy the ones it uses into
    /// memory of its own backed by huge pages ([`Load::Auto`], for a file that fits), rather
    /// than read them from the map.
    pub fn host_copies(&self) -> bool {
        self.host_copies
    }

    /// Parses `bytes` as if they were the file `name` (copied into an anonymous map): for the
    /// fuzzer and tests, which have no file on disk.
    pub fn from_bytes(name: impl AsRef<Path>, bytes: &[u8]) -> Result<Self> {
        let path = name.as_ref().to_path_buf();
        if bytes.is_empty() {
            return Err(Error::Gguf {
                path,
                msg: "empty file: not a GGUF file".into(),
            });
        }
        let mut map = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(&path, e))?;
        map.copy_from_slice(bytes);
        let map = map.make_read_only().map_err(|e| Error::io(&path, e))?;
        Self::parse(path, map)
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<Self> {
        let mut c = Cursor {
            buf: &mmap[..],
            pos: 0,
            path: &path,
        };
        let magic = c.take(4, "magic")?;
        if magic != GGUF_MAGIC {
            return Err(c.err(format!(
                "wrong magic {:?} (expected \"GGUF\"): not a GGUF file",
                String::from_utf8_lossy(magic)
            )));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => return Err(c.err("GGUF version 1 is not supported (only versions 2 and 3)")),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(c.err("big-endian GGUF files are not supported"));
            }
            v => return Err(c.err(format!("unsupported GGUF version {v} (only 2 and 3)"))),
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // Each metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor entry
        // at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
        if n_kv > c.remaining() / 13 {
            return Err(c.err(format!(
                "metadata count {n_kv} is absurd for a file of {} bytes",
                c.buf.len()
            )));
        }
        if n_tensors > c.remaining() / 24 {
            return Err(c.err(format!(
                "tensor count {n_tensors} is absurd for a file of {} bytes",
                c.buf.len()
            )));
        }

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            if key.len() as u64 > MAX_NAME_LEN {
                return Err(c.err(format!("metadata key #{i} is {} bytes long", key.len())));
            }
            let at = c.pos;
            let tid = c.u32(&key)?;
            let ty = ValueType::from_id(tid).ok_or_else(|| {
                c.err(format!(
                    "metadata {key:?}: unknown value type {tid} at offset {at}"
                ))
            })?;
            let value = c.value(ty, &format!("metadata {key:?}"), 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(c.err(format!("metadata key {key:?} appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some(v) => {
                return Err(c.err(format!(
                    "general.alignment must be a u32 power of two, found {}",
                    v.summary()
                )));
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor #{i} name"))?;
            if name.len() as u64 > MAX_NAME_LEN {
                return Err(c.err(format!("tensor #{i} name is {} bytes long", name.len())));
            }
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.err(format!(
                    "tensor {name:?}: {n_dims} dimensions (must be 1 to {MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut n_elements: u64 = 1;
            for _ in 0..n_dims {
                let d = c.u64(&name)?;
                dims.push(d);
                n_elements = n_elements
                    .checked_mul(d)
                    .filter(|&n| n < (1 << 62))
                    .ok_or_else(|| {
                        c.err(format!(
                            "tensor {name:?}: shape {dims:?} has too many elements"
                        ))
                    })?;
            }
            let tid = c.u32(&name)?;
            let ty = GgmlType::from_id(tid).map_err(|e| c.err(format!("tensor {name:?}: {e}")))?;
            let offset = c.u64(&name)?;
            if dims[0] % ty.block_size() as u64 != 0 {
                return Err(c.err(format!(
                    "tensor {name:?}: row length {} is not a multiple of the {ty} block size {}",
                    dims[0],
                    ty.block_size()
                )));
            }
            let n_bytes = n_elements / ty.block_size() as u64 * ty.type_size() as u64;
            if offset % alignment != 0 {
                return Err(c.err(format!(
                    "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(c.err(format!("tensor name {name:?} appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let data_offset = c.pos.div_ceil(alignment) * alignment;
        let file_len = c.buf.len() as u64;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > file_len) {
                return Err(c.err(format!(
                    "tensor {:?} ({} {}, {} bytes at data offset {}) runs past the end of the file \
                     ({file_len} bytes, data section at {data_offset})",
                    t.name,
                    t.ty,
                    t.shape_string(),
                    t.n_bytes,
                    t.offset
                )));
            }
        }

        Ok(GgufFile {
            path,
            mmap,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
            host_copies: false,
        })
    }

    fn meta_err(&self, msg: String) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            msg,
        }
    }

    pub fn file_size(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// The raw bytes of the whole file (for fingerprints).
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// An integer metadata value of any integer type; an error when present with another type or
    /// out of range for u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(i) if i >= 0 && i <= u64::MAX as i128 => Ok(Some(i as u64)),
                _ => Err(self.meta_err(format!(
                    "metadata {key:?} should be a non-negative integer, found {}",
                    v.summary()
                ))),
            },
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                self.meta_err(format!(
                    "metadata {key:?} should be a number, found {}",
                    v.summary()
                ))
            }),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                self.meta_err(format!(
                    "metadata {key:?} should be a bool, found {}",
                    v.summary()
                ))
            }),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of tensor `name`, straight from the memory map.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self
            .tensor(name)
            .ok_or_else(|| self.meta_err(format!("no tensor named {name:?}")))?;
        Ok(self.data_of(t))
    }

    /// The bytes of a tensor of this file (bounds were checked when the file was opened).
    pub fn data_of(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.mmap[start..start + t.n_bytes as usize]
    }

    /// Bytes of the header and tensor table (everything before the data section).
    pub fn header_bytes(&self) -> &[u8] {
        &self.mmap[..(self.data_offset as usize).min(self.mmap.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Auto copies a file of at least 64 MiB that takes at most half of the memory available,
    /// and nothing when the memory available is unknown.
    #[test]
    fn auto_copies_big_files_that_fit_twice() {
        let gib = 1u64 << 30;
        assert!(auto_copies(4 * gib, || Some(8 * gib)));
        assert!(!auto_copies(4 * gib + 1, || Some(8 * gib)));
        assert!(!auto_copies(AUTO_MIN_BYTES - 1, || Some(8 * gib)));
        assert!(auto_copies(AUTO_MIN_BYTES, || Some(8 * gib)));
        // A small file never asks for the memory available.
        assert!(!auto_copies(AUTO_MIN_BYTES - 1, || panic!("asked")));
        assert!(!auto_copies(gib, || None));
        assert!(mem_available().is_some_and(|a| a > 0) || !cfg!(target_os = "linux"));
    }
}
