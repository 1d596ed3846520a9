//! Block layouts of ggml's quantised formats, byte for byte as `ggml-common.h` declares them, and a
//! sound zero-copy view of raw tensor bytes as a slice of blocks.
//!
//! Alignment: every field wider than a byte is held as a little-endian byte array ([`F16Le`],
//! [`F32Le`], [`I16Le`]), so every block struct has alignment 1 and no padding. GGUF aligns only
//! the start of each tensor (to 32 bytes) and blocks such as [`BlockQ4_1`] are 20 bytes long, so a
//! view of arbitrary mapped bytes as `&[BlockQ4_1]` can be sound only for alignment-1 types; with
//! them [`as_blocks`] never needs an alignment check or a copy. Reading a field is one unaligned
//! load (full speed on x86-64 and aarch64), and the layouts read the same on big-endian hosts.

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// Elements in a K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;
/// Elements in a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q8_1 block.
pub const QK: usize = 32;
/// Bytes of packed 6-bit scales and mins in Q4_K and Q5_K (ggml's `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

// ---------------------------------------------------------------------------------------------
// Little-endian scalar fields of alignment 1

/// An IEEE half (`ggml_half`) stored as two little-endian bytes.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct F16Le(pub [u8; 2]);

impl F16Le {
    pub const fn from_bits(bits: u16) -> Self {
        F16Le(bits.to_le_bytes())
    }
    pub const fn bits(self) -> u16 {
        u16::from_le_bytes(self.0)
    }
    /// Round to nearest, ties to even, as ggml's `GGML_FP32_TO_FP16`.
    pub fn from_f32(x: f32) -> Self {
        Self::from_bits(half::f16::from_f32(x).to_bits())
    }
    /// Exact widening, as ggml's `GGML_FP16_TO_FP32`.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.bits())
    }
}

impl std::fmt::Debug for F16Le {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}f16", self.to_f32())
    }
}

/// An IEEE single stored as four little-endian bytes.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct F32Le(pub [u8; 4]);

impl F32Le {
    pub const fn new(x: f32) -> Self {
        F32Le(x.to_le_bytes())
    }
    #[inline(always)]
    pub const fn get(self) -> f32 {
        f32::from_le_bytes(self.0)
    }
}

impl std::fmt::Debug for F32Le {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}f32", self.get())
    }
}

/// A signed 16-bit integer stored as two little-endian bytes.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct I16Le(pub [u8; 2]);

impl I16Le {
    pub const fn new(x: i16) -> Self {
        I16Le(x.to_le_bytes())
    }
    #[inline(always)]
    pub const fn get(self) -> i16 {
        i16::from_le_bytes(self.0)
    }
}

impl std::fmt::Debug for I16Le {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}i16", self.get())
    }
}

/// IEEE half bits to f32, exactly (subnormals and infinities included; NaNs stay NaN), without
/// branches or tables so that loops over it vectorise. The same method as ggml's
/// `ggml_compute_fp16_to_fp32`: normal values get their exponent re-biased by one multiply,
/// subnormals are built as `0.5 + m * 2^-24` in a float with exponent -1 and take back 0.5.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let w = (h as u32) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w); // drops the sign
    // exponent and mantissa moved into f32 position, exponent bias raised by 224 then scaled by
    // 2^-112: net re-bias 127 - 15; infinities and NaNs land on f32's maximum exponent.
    let normalized = f32::from_bits((two_w >> 4) + (0xE0 << 23)) * f32::from_bits(0x0780_0000);
    let denormalized = f32::from_bits((two_w >> 17) | (126 << 23)) - 0.5;
    let bits = if two_w < (1 << 27) {
        denormalized.to_bits()
    } else {
        normalized.to_bits()
    };
    f32::from_bits(sign | bits)
}

/// bfloat16 bits to f32: exact, the bits become the high half.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bfloat16 bits as ggml's `ggml_compute_fp32_to_bf16`: NaNs are made quiet, everything else
/// rounds to nearest, ties to even (no flush of subnormals).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

// ---------------------------------------------------------------------------------------------
// Blocks

/// A ggml block: a plain-bytes struct that can be viewed in place inside a byte slice.
///
/// # Safety
/// Implementors are `#[repr(C)]`, have alignment 1 and no padding, and every byte pattern of
/// `size_of::<Self>()` bytes is a valid value. (All fields are `u8`/`i8` arrays or the `*Le` types.)
pub unsafe trait Block: Copy + 'static {
    /// The ggml type whose block this is.
    const TYPE: GgmlType;

    /// A block of zero bytes (all scales +0.0, all quants 0).
    fn zeroed() -> Self {
        // SAFETY: the trait's contract makes every byte pattern, all zeros included, valid.
        unsafe { std::mem::zeroed() }
    }
}

/// Block of 32 weights `x = d * (q - 8)`, q in 0..16.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4_0 {
    pub d: F16Le,         // delta
    pub qs: [u8; QK / 2], // nibbles / quants: element j in the low nibble of qs[j], j+16 in the high
}
const _: () = assert!(size_of::<BlockQ4_0>() == 18);

/// Block of 32 weights `x = d * q + m`, q in 0..16.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4_1 {
    pub d: F16Le,         // delta
    pub m: F16Le,         // min
    pub qs: [u8; QK / 2], // nibbles / quants, as BlockQ4_0
}
const _: () = assert!(size_of::<BlockQ4_1>() == 20);

/// Block of 32 weights `x = d * (q - 16)`, q in 0..32.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ5_0 {
    pub d: F16Le,         // delta
    pub qh: [u8; 4],      // 5-th bit of quants: bit j of the little-endian u32 is element j's
    pub qs: [u8; QK / 2], // nibbles / quants, as BlockQ4_0
}
const _: () = assert!(size_of::<BlockQ5_0>() == 22);

/// Block of 32 weights `x = d * q + m`, q in 0..32.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ5_1 {
    pub d: F16Le,         // delta
    pub m: F16Le,         // min
    pub qh: [u8; 4],      // 5-th bit of quants, as BlockQ5_0
    pub qs: [u8; QK / 2], // nibbles / quants, as BlockQ4_0
}
const _: () = assert!(size_of::<BlockQ5_1>() == 24);

/// Block of 32 values `x = d * q`, q in -128..128.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8_0 {
    pub d: F16Le,     // delta
    pub qs: [i8; QK], // quants
}
const _: () = assert!(size_of::<BlockQ8_0>() == 34);

/// Block of 32 values `x = d * q` that also carries `s = d * sum(q)` (activations for Q4_1/Q5_1).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8_1 {
    pub d: F16Le,     // delta
    pub s: F16Le,     // d * sum(qs[i])
    pub qs: [i8; QK], // quants
}
const _: () = assert!(size_of::<BlockQ8_1>() == 36);

/// Super-block of 256 weights in 16 groups of 16: `x = d * sc * q - dmin * m`, q in 0..4.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16], // scales (low nibble) and mins (high nibble), 4 bits each
    pub qs: [u8; QK_K / 4],      // quants, 2 bits each
    pub d: F16Le,                // super-block scale for quantized scales
    pub dmin: F16Le,             // super-block scale for quantized mins
}
const _: () = assert!(size_of::<BlockQ2K>() == 84);

/// Super-block of 256 weights in 16 groups of 16: `x = d * (sc - 32) * q`, q in -4..4.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8], // quants - high bit (set means no -4 offset)
    pub qs: [u8; QK_K / 4],    // quants - low 2 bits
    pub scales: [u8; 12],      // scales, quantized with 6 bits
    pub d: F16Le,              // super-block scale
}
const _: () = assert!(size_of::<BlockQ3K>() == 110);

/// Super-block of 256 weights in 8 groups of 32: `x = d * sc * q - dmin * m`, q in 0..16.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4K {
    pub d: F16Le,                   // super-block scale for quantized scales
    pub dmin: F16Le,                // super-block scale for quantized mins
    pub scales: [u8; K_SCALE_SIZE], // scales and mins, quantized with 6 bits
    pub qs: [u8; QK_K / 2],         // 4-bit quants
}
const _: () = assert!(size_of::<BlockQ4K>() == 144);

/// Super-block of 256 weights in 8 groups of 32: `x = d * sc * q - dmin * m`, q in 0..32.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ5K {
    pub d: F16Le,                   // super-block scale for quantized scales
    pub dmin: F16Le,                // super-block scale for quantized mins
    pub scales: [u8; K_SCALE_SIZE], // scales and mins, quantized with 6 bits
    pub qh: [u8; QK_K / 8],         // quants, high bit
    pub qs: [u8; QK_K / 2],         // quants, low 4 bits
}
const _: () = assert!(size_of::<BlockQ5K>() == 176);

/// Super-block of 256 weights in 16 groups of 16: `x = d * sc * (q - 32)`, q in 0..64.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],      // quants, lower 4 bits
    pub qh: [u8; QK_K / 4],      // quants, upper 2 bits
    pub scales: [i8; QK_K / 16], // scales, quantized with 8 bits
    pub d: F16Le,                // super-block scale
}
const _: () = assert!(size_of::<BlockQ6K>() == 210);

/// Super-block of 256 activations `x = d * q` for the K-quant dot products (never stored in files).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8K {
    pub d: F32Le,                  // delta
    pub qs: [i8; QK_K],            // quants
    pub bsums: [I16Le; QK_K / 16], // sum of quants in groups of 16
}
const _: () = assert!(size_of::<BlockQ8K>() == 292);

/// The sixteen values of the non-linear 4-bit formats (ggml's `kvalues_iq4nl`): a quant `q` in
/// 0..16 stands for `IQ4_VALUES[q]`, in -127..=113.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Block of 32 weights `x = d * IQ4_VALUES[q]`, q in 0..16, nibbles as Q4_0's.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIQ4NL {
    pub d: F16Le,         // delta
    pub qs: [u8; QK / 2], // element j in the low nibble of qs[j], j+16 in the high
}
const _: () = assert!(size_of::<BlockIQ4NL>() == 18);

/// Super-block of 256 weights in 8 groups of 32: `x = d * (ls - 32) * IQ4_VALUES[q]`, ls the
/// group's 6-bit scale (low 4 bits from `scales_l`, high 2 from `scales_h`); group j's 32 quants
/// in `qs[16j..16j + 16]` as a Q4_0 block's.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIQ4XS {
    pub d: F16Le,                  // super-block scale
    pub scales_h: [u8; 2],         // bits 2j..2j + 2: group j's scale, high 2 bits
    pub scales_l: [u8; QK_K / 64], // nibble j % 2 of byte j / 2: group j's scale, low 4 bits
    pub qs: [u8; QK_K / 2],        // quants, 4 bits
}
const _: () = assert!(size_of::<BlockIQ4XS>() == 136);

/// Sixteen bytes of IQ4 nibbles as their 32 values in element order: the low nibbles of `qs`,
/// then the high ones (an IQ4_NL block, or one 32-element group of an IQ4_XS super-block).
#[inline(always)]
pub fn iq4_values(qs: &[u8; QK / 2]) -> [i8; QK] {
    std::array::from_fn(|e| {
        let b = qs[e % (QK / 2)];
        IQ4_VALUES[(if e < QK / 2 { b & 0x0F } else { b >> 4 }) as usize]
    })
}

impl BlockIQ4XS {
    /// Group `j`'s sixteen quant bytes.
    #[inline(always)]
    pub fn group(&self, j: usize) -> &[u8; QK / 2] {
        &self.qs.as_chunks::<{ QK / 2 }>().0[j]
    }

    /// Group `j`'s scale `ls - 32`, in -32..32.
    #[inline(always)]
    pub fn scale(&self, j: usize) -> i32 {
        let lo = (self.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        let hi = (u16::from_le_bytes(self.scales_h) >> (2 * j)) & 3;
        (lo as i32 | (hi as i32) << 4) - 32
    }
}

macro_rules! impl_block {
    ($($block:ty => $ty:ident),* $(,)?) => {$(
        const _: () = assert!(align_of::<$block>() == 1);
        // SAFETY: `#[repr(C)]`, fields are only u8/i8 arrays and alignment-1 `*Le` byte arrays, so
        // alignment is 1 (asserted above), there is no padding (sizes asserted equal to the sum of
        // the fields) and any byte pattern is a valid value.
        unsafe impl Block for $block {
            const TYPE: GgmlType = GgmlType::$ty;
        }
    )*};
}

impl_block!(
    BlockQ4_0 => Q4_0, BlockQ4_1 => Q4_1, BlockQ5_0 => Q5_0, BlockQ5_1 => Q5_1,
    BlockQ8_0 => Q8_0, BlockQ8_1 => Q8_1, BlockQ2K => Q2_K, BlockQ3K => Q3_K,
    BlockQ4K => Q4_K, BlockQ5K => Q5_K, BlockQ6K => Q6_K, BlockQ8K => Q8_K,
    BlockIQ4NL => IQ4_NL, BlockIQ4XS => IQ4_XS,
);

/// View `bytes` as blocks in place; an error when the length is not a whole number of blocks.
pub fn as_blocks<B: Block>(bytes: &[u8]) -> Result<&[B]> {
    check_whole::<B>(bytes.len())?;
    Ok(blocks_prefix(bytes))
}

/// View `bytes` as mutable blocks in place; an error when the length is not a whole number of blocks.
pub fn as_blocks_mut<B: Block>(bytes: &mut [u8]) -> Result<&mut [B]> {
    check_whole::<B>(bytes.len())?;
    Ok(blocks_prefix_mut(bytes))
}

/// View blocks as their bytes.
pub fn blocks_as_bytes<B: Block>(blocks: &[B]) -> &[u8] {
    // SAFETY: `B: Block` has no padding, so all `size_of_val(blocks)` bytes are initialised; u8 has
    // alignment 1 and the lifetime is carried over.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), size_of_val(blocks)) }
}

fn check_whole<B: Block>(len: usize) -> Result<()> {
    let size = size_of::<B>();
    if !len.is_multiple_of(size) {
        return Err(Error::Model(format!(
            "{len} bytes is not a whole number of {size}-byte {} blocks",
            B::TYPE
        )));
    }
    Ok(())
}

/// The whole blocks at the start of `bytes` (a trailing partial block is left out).
#[inline]
pub(crate) fn blocks_prefix<B: Block>(bytes: &[u8]) -> &[B] {
    let n = bytes.len() / size_of::<B>();
    // SAFETY: `B: Block` has alignment 1, so any pointer is aligned for it; `n` blocks fit inside
    // `bytes`; every byte pattern is a valid `B`; the borrow keeps `bytes` alive and unchanged.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), n) }
}

/// Mutable twin of [`blocks_prefix`].
#[inline]
pub(crate) fn blocks_prefix_mut<B: Block>(bytes: &mut [u8]) -> &mut [B] {
    let n = bytes.len() / size_of::<B>();
    // SAFETY: as in `blocks_prefix`; the unique borrow of `bytes` moves to the result, and any
    // value written through it is a valid byte pattern.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<B>(), n) }
}

// ---------------------------------------------------------------------------------------------
// Packed K-quant scales

/// Q3_K's sixteen 6-bit scales, unpacked and re-centred (`scale - 32`, so in -32..32).
///
/// Packing: scale `s` has its low 4 bits in `raw[s]` (low nibble, s < 8) or `raw[s - 8]` (high
/// nibble), and its high 2 bits at bit `2 * (s / 4)` of `raw[8 + s % 4]`.
#[inline]
pub fn q3_k_scales(raw: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (s, o) in out.iter_mut().enumerate() {
        let low = if s < 8 {
            raw[s] & 0x0F
        } else {
            raw[s - 8] >> 4
        };
        let high = (raw[8 + s % 4] >> (2 * (s / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Q4_K / Q5_K's eight 6-bit scales and eight 6-bit mins (ggml's `get_scale_min_k4` for j in 0..8).
///
/// Packing: for j < 4, scale j and min j are the low 6 bits of `raw[j]` and `raw[j + 4]`; for
/// j >= 4 their low 4 bits are the low / high nibble of `raw[j + 4]` and their high 2 bits are the
/// top bits of `raw[j - 4]` / `raw[j]`.
#[inline]
pub fn k4_scales_mins(raw: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = raw[j] & 63;
        m[j] = raw[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (raw[j + 4] & 0x0F) | ((raw[j - 4] >> 6) << 4);
        m[j] = (raw[j + 4] >> 4) | ((raw[j] >> 6) << 4);
    }
    (sc, m)
}

/// The inverse of [`k4_scales_mins`]: eight 6-bit scales and eight 6-bit mins packed as Q4_K / Q5_K
/// store them. Values above 63 keep only their low 6 bits.
#[inline]
pub fn pack_k4_scales_mins(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut raw = [0u8; K_SCALE_SIZE];
    for j in 0..4 {
        raw[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        raw[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        raw[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    raw
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_the_type_table() {
        fn check<B: Block>() {
            assert_eq!(size_of::<B>(), B::TYPE.type_size(), "{}", B::TYPE);
        }
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
    }

    #[test]
    fn blocks_view_unaligned_bytes_in_place() {
        // A Q4_1 block starting at an odd address: fields read from their byte offsets.
        let mut buf = [0u8; 1 + 2 * 20];
        buf[1..3].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        buf[3..5].copy_from_slice(&half::f16::from_f32(-2.0).to_bits().to_le_bytes());
        buf[5] = 0xA3;
        buf[21 + 19] = 0x5C;
        let blocks: &[BlockQ4_1] = as_blocks(&buf[1..]).unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].d.to_f32(), 0.5);
        assert_eq!(blocks[0].m.to_f32(), -2.0);
        assert_eq!(blocks[0].qs[0], 0xA3);
        assert_eq!(blocks[1].qs[15], 0x5C);
        assert!(as_blocks::<BlockQ4_1>(&buf[..39]).is_err());
        assert_eq!(blocks_as_bytes(blocks), &buf[1..]);
    }

    #[test]
    fn f16_to_f32_is_exact_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "f16 bits {h:#06x}: got {got:e} ({:#010x}) want {want:e} ({:#010x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_quiets_nans() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to the even one, 1.0.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1.0078125 + half an ulp: ties to the even one above, 1.015625.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7F80_0001)), 0x7FC0);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_to_f32(0xC040), -3.0);
    }

    #[test]
    fn packed_k_scales_unpack_as_ggml_documents() {
        // Q3_K: scale 5 = low nibble of raw[5] | bits 2..4 of raw[9] as its high bits.
        let mut raw = [0u8; 12];
        raw[5] = 0x0B;
        raw[9] = 0b0000_1000; // bits 2..4 = 0b10
        let s = q3_k_scales(&raw);
        assert_eq!(s[5], (0x0B | (0b10 << 4)) - 32);
        assert_eq!(s[0], -32);
        // scale 14: high nibble of raw[6], bits 6..8 of raw[10]
        raw[6] = 0x70;
        raw[10] = 0b1100_0000;
        assert_eq!(q3_k_scales(&raw)[14], (0x7 | (0b11 << 4)) - 32);

        // Q4_K: scale/min 6 take low/high nibble of raw[10] and the top bits of raw[2]/raw[6].
        let mut raw = [0u8; 12];
        raw[10] = 0x9C;
        raw[2] = 0b1000_0001;
        raw[6] = 0b0100_0011;
        let (sc, m) = k4_scales_mins(&raw);
        assert_eq!(sc[6], 0xC | (0b10 << 4));
        assert_eq!(m[6], 0x9 | (0b01 << 4));
        assert_eq!(sc[2], 1);
        assert_eq!(m[2], 3);
    }

    #[test]
    fn packed_k4_scales_round_trip() {
        let sc = [0, 63, 17, 42, 5, 63, 48, 33];
        let m = [63, 0, 1, 62, 60, 31, 16, 47];
        let raw = pack_k4_scales_mins(&sc, &m);
        assert_eq!(k4_scales_mins(&raw), (sc, m));
        // scale 6 = 48 = 0b11_0000: low nibble 0 in raw[10], high bits 0b11 at the top of raw[2]
        assert_eq!(raw[10] & 0x0F, 0);
        assert_eq!(raw[2] >> 6, 0b11);
    }
}
