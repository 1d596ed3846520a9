//! On-disk caches (compiled CUDA kernels, profiles): the folder they live in and the hash that
//! names their entries.

use std::path::PathBuf;

/// `$OATO_CACHE_DIR`, else `$XDG_CACHE_HOME/oato`, else `~/.cache/oato`; `None` without a home.
pub fn root() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("OATO_CACHE_DIR") {
        Some(PathBuf::from(d))
    } else if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        Some(PathBuf::from(d).join("oato"))
    } else {
        Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache/oato"))
    }
}

/// FNV-1a (64-bit) over the parts, each followed by a separator byte so that ("ab", "c") and
/// ("a", "bc") differ.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in p.iter().chain(&[0xff]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
