//! AVX-512 variant: the AVX2 kernels with their integer dot products done by VNNI
//! (`vpdpbusd` on 256-bit registers), which sums the same four consecutive products into each i32
//! lane, so results stay bit-identical with `scalar` and `avx2`.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use crate::quant::blocks::*;

/// Eight i32 lanes of four consecutive unsigned x signed byte products, by VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_us8(a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
}

/// As [`dot_us8`] for signed `a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_ss8(a: __m256i, b: __m256i) -> __m256i {
    dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
}

super::avx2::block_kernels!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    dot_us8,
    dot_ss8
);
