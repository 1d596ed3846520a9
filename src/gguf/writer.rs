//! GGUF writer: metadata and tensors to a version-3 file with aligned tensor data. Used by tests,
//! fixtures and `oato synth`. Tensor type ids are written as given, so tests can make bad files.

use std::io::Write;
use std::path::Path;

use super::value::Value;
use crate::error::{Error, Result};
use crate::quant::GgmlType;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF file.
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
        let n: u64 = dims.iter().product();
        let want = n / ty.block_size() as u64 * ty.type_size() as u64;
        if dims.first().is_none_or(|d| d % ty.block_size() as u64 != 0) || want != data.len() as u64
        {
            return Err(Error::Msg(format!(
                "tensor {name:?}: {ty} {dims:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        self.add_tensor_raw(name, dims, ty.id(), data);
        Ok(())
    }

    /// Adds a tensor without any check (for making malformed files in tests).
    pub fn add_tensor_raw(&mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            write_value(&mut out, v);
        }
        let align = self.alignment;
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(align) * align;
        }
        pad_to(&mut out, align);
        let data_start = out.len() as u64;
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        pad_to(&mut out, align);
        out
    }

    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        f.write_all(&self.to_bytes())
            .map_err(|e| Error::io(path, e))
    }
}

fn pad_to(out: &mut Vec<u8>, align: u64) {
    let len = (out.len() as u64).div_ceil(align) * align;
    out.resize(len as usize, 0);
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
