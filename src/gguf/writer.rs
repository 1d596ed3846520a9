//! GGUF writer: metadata and tensors to a version-3 file with aligned tensor data, from memory or
//! streamed one tensor at a time. Used by tests, fixtures and `oato synth`. Tensor type ids are
//! written as given, so tests can make bad files.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::value::Value;
use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// A tensor's entry in the tensor table: name, dims in ggml order (row length first), type id and
/// the bytes its data takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub n_bytes: u64,
}

impl TensorEntry {
    /// The entry of a `ty` tensor of `dims`; an error when a row is not a whole number of blocks or
    /// the byte count overflows.
    pub fn new(name: &str, dims: &[u64], ty: GgmlType) -> Result<Self> {
        let bs = ty.block_size() as u64;
        let n_bytes = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| (n / bs).checked_mul(ty.type_size() as u64))
            .filter(|_| dims.first().is_some_and(|d| d % bs == 0))
            .ok_or_else(|| {
                Error::Msg(format!(
                    "tensor {name:?}: {dims:?} is not rows of whole {bs}-element {ty} blocks, or \
                     overflows"
                ))
            })?;
        Ok(TensorEntry {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: ty.id(),
            n_bytes,
        })
    }
}

struct PendingTensor {
    entry: TensorEntry,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF file: all at once from memory
/// ([`GgufWriter::write`]), or with tensors whose bytes are made one at a time while writing
/// ([`GgufWriter::write_streamed`]).
pub struct GgufWriter {
    pub version: u32,
    pub alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: 32,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Adds (or replaces) a metadata entry. `general.alignment` also sets the data alignment.
    pub fn set(&mut self, key: &str, value: Value) -> &mut Self {
        if key == "general.alignment"
            && let Value::U32(a) = value
            && a > 0
        {
            self.alignment = a as u64;
        }
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        self
    }

    /// Adds a tensor; `dims` in ggml order (row length first). Checks the byte count.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<()> {
        let entry = TensorEntry::new(name, dims, ty)?;
        if entry.n_bytes != data.len() as u64 {
            return Err(Error::Msg(format!(
                "tensor {name:?}: {ty} {dims:?} needs {} bytes, got {}",
                entry.n_bytes,
                data.len()
            )));
        }
        self.tensors.push(PendingTensor { entry, data });
        Ok(())
    }

    /// Adds a tensor without any check (for making malformed files in tests).
    pub fn add_tensor_raw(&mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) {
        let entry = TensorEntry {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            n_bytes: data.len() as u64,
        };
        self.tensors.push(PendingTensor { entry, data });
    }

    /// Header, metadata and tensor table for the added tensors followed by `streamed`, padded to
    /// the alignment: everything before the first tensor's data.
    fn header(&self, streamed: &[TensorEntry]) -> Vec<u8> {
        let entries: Vec<&TensorEntry> = self
            .tensors
            .iter()
            .map(|t| &t.entry)
            .chain(streamed)
            .collect();
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offset = 0u64;
        for t in entries {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = self.padded(offset + t.n_bytes);
        }
        out.resize(self.padded(out.len() as u64) as usize, 0);
        out
    }

    /// `n` rounded up to the alignment.
    fn padded(&self, n: u64) -> u64 {
        n.div_ceil(self.alignment) * self.alignment
    }

    /// Writes the file to `w`: the added tensors' data from memory, then each of `streamed`'s from
    /// `produce(i, buf)`, which fills `buf` (its `n_bytes` long, zeroed the first time) with tensor
    /// `i`'s bytes. One streamed tensor is in memory at a time. Returns the bytes written.
    fn write_to(
        &self,
        w: &mut impl Write,
        streamed: &[TensorEntry],
        mut produce: impl FnMut(usize, &mut [u8]) -> Result<()>,
        io: impl Fn(std::io::Error) -> Error,
    ) -> Result<u64> {
        let header = self.header(streamed);
        w.write_all(&header).map_err(&io)?;
        let mut written = header.len() as u64;
        let zeros = vec![0u8; self.alignment as usize];
        let mut put = |w: &mut dyn Write, bytes: &[u8]| -> Result<()> {
            let pad = (self.padded(bytes.len() as u64) - bytes.len() as u64) as usize;
            w.write_all(bytes).map_err(&io)?;
            w.write_all(&zeros[..pad]).map_err(&io)?;
            written += (bytes.len() + pad) as u64;
            Ok(())
        };
        for t in &self.tensors {
            put(w, &t.data)?;
        }
        let mut buf = Vec::new();
        for (i, t) in streamed.iter().enumerate() {
            buf.resize(t.n_bytes as usize, 0);
            produce(i, &mut buf)?;
            put(w, &buf)?;
        }
        w.flush().map_err(&io)?;
        Ok(written)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out, &[], |_, _| Ok(()), |e| Error::Msg(e.to_string()))
            .expect("writing to memory does not fail");
        out
    }

    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_streamed(path, &[], |_, _| Ok(())).map(|_| ())
    }

    /// Writes the file at `path` through a buffer: the metadata, the added tensors, then the
    /// `streamed` tensors whose bytes `produce(i, buf)` makes one at a time (see `write_to`). A
    /// file left half-written by an error is removed. Returns the file's size.
    pub fn write_streamed(
        &self,
        path: impl AsRef<Path>,
        streamed: &[TensorEntry],
        produce: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let path = path.as_ref();
        let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let r = self.write_to(&mut w, streamed, produce, |e| Error::io(path, e));
        if r.is_err() {
            drop(w);
            let _ = std::fs::remove_file(path);
        }
        r
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_string(out, s),
        Value::Array(t, items) => {
            out.extend_from_slice(&(*t as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}
