//! CUDA kernel sources, embedded with `include_str!`, compiled by NVRTC at run time for the
//! device's architecture into CUBIN, and cached on disk by (source hash, architecture, NVRTC
//! version). `oato selftest --compile-only` and CI use this same path without a GPU.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::PathBuf;

use cudarc::nvrtc::sys as nv;

use crate::cache::fnv1a;
use crate::error::{Error, Result};

/// The header every source includes, mirroring `src/quant`'s block layouts.
pub const HEADER: (&str, &str) = ("common.cuh", include_str!("common.cuh"));

/// One kernel source file.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub code: &'static str,
}

pub const SOURCES: &[Source] = &[
    Source {
        name: "quantize.cu",
        code: include_str!("quantize.cu"),
    },
    Source {
        name: "mmvq.cu",
        code: include_str!("mmvq.cu"),
    },
    Source {
        name: "split.cu",
        code: include_str!("split.cu"),
    },
    Source {
        name: "mmq.cu",
        code: include_str!("mmq.cu"),
    },
    Source {
        name: "dequant.cu",
        code: include_str!("dequant.cu"),
    },
    Source {
        name: "ops.cu",
        code: include_str!("ops.cu"),
    },
    Source {
        name: "flash_decode.cu",
        code: include_str!("flash_decode.cu"),
    },
    Source {
        name: "flash_prefill.cu",
        code: include_str!("flash_prefill.cu"),
    },
];

/// Whether libnvrtc can be loaded (checked before any other NVRTC call: cudarc panics when the
/// library is missing).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { nv::is_culib_present() }
}

fn nv_err(what: &str, r: nv::nvrtcResult) -> Error {
    Error::Msg(format!("NVRTC {what}: {r:?}"))
}

fn nv_check(what: &str, r: nv::nvrtcResult) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(nv_err(what, r))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(Error::Msg(
            "libnvrtc not found (install the CUDA toolkit or put libnvrtc on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let (mut major, mut minor) = (0 as c_int, 0 as c_int);
    // SAFETY: both pointers are valid for writes.
    nv_check("version", unsafe {
        nv::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// Directories searched for CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`, which NVRTC 13.0 does not
/// find on its own): `OATO_CUDA_INCLUDE` (colon-separated), then the toolkit's include folder;
/// only those that exist.
pub fn include_dirs() -> Vec<String> {
    let mut v: Vec<String> = std::env::var("OATO_CUDA_INCLUDE")
        .map(|s| {
            s.split(':')
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(p) = std::env::var(var) {
            v.push(format!("{p}/include"));
        }
    }
    v.push("/usr/local/cuda/include".into());
    v.retain(|p| std::path::Path::new(p).is_dir());
    v.dedup();
    v
}

/// The compiler options for architecture `sm_<arch>` (e.g. 90 for an H100).
pub fn options(arch: u32) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture=sm_{arch}"),
        "-std=c++17".to_string(),
        "--use_fast_math".to_string(),
    ];
    o.extend(
        include_dirs()
            .into_iter()
            .map(|d| format!("--include-path={d}")),
    );
    o
}

/// Compiles `src` for `sm_<arch>` and returns the CUBIN, or the compiler log as the error.
pub fn compile(src: &Source, arch: u32) -> Result<Vec<u8>> {
    nvrtc_version()?;
    let code = CString::new(src.code).map_err(|_| Error::Msg(format!("{}: NUL byte", src.name)))?;
    let name = CString::new(src.name).map_err(|_| Error::Msg("bad source name".into()))?;
    let h_code = CString::new(HEADER.1).map_err(|_| Error::Msg("header: NUL byte".into()))?;
    let h_name = CString::new(HEADER.0).map_err(|_| Error::Msg("bad header name".into()))?;
    let headers = [h_code.as_ptr()];
    let include_names = [h_name.as_ptr()];
    let opts: Vec<CString> = options(arch)
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| Error::Msg("bad NVRTC option".into())))
        .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive until the program is destroyed.
    nv_check("create program", unsafe {
        nv::nvrtcCreateProgram(
            &mut prog,
            code.as_ptr(),
            name.as_ptr(),
            1,
            headers.as_ptr(),
            include_names.as_ptr(),
        )
    })?;
    // SAFETY: `prog` was created above; the option pointers outlive the call.
    let r = unsafe { nv::nvrtcCompileProgram(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let log = program_log(prog);
    let out = if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let hint = if include_dirs().is_empty() {
            "\n(no CUDA include directory found: set OATO_CUDA_INCLUDE to a folder with cuda_fp16.h)"
        } else {
            ""
        };
        Err(Error::Msg(format!(
            "NVRTC failed to compile {} for sm_{arch} ({r:?}) with options {:?}:\n{}{hint}",
            src.name,
            options(arch),
            log.trim_end()
        )))
    } else if !log.trim().is_empty() && std::env::var_os("OATO_NVRTC_WERROR").is_some() {
        Err(Error::Msg(format!(
            "NVRTC warnings for {} (OATO_NVRTC_WERROR is set):\n{}",
            src.name,
            log.trim_end()
        )))
    } else {
        cubin(prog)
    };
    // SAFETY: destroys the program created above, once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    out
}

fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut n = 0usize;
    // SAFETY: `prog` is a live program; `n` is valid for writes.
    if unsafe { nv::nvrtcGetProgramLogSize(prog, &mut n) } != nv::nvrtcResult::NVRTC_SUCCESS
        || n == 0
    {
        return String::new();
    }
    let mut buf = vec![0 as c_char; n];
    // SAFETY: `buf` holds the `n` bytes NVRTC reported.
    if unsafe { nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr()) } != nv::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    // SAFETY: NVRTC NUL-terminates the log within `n` bytes.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn cubin(prog: nv::nvrtcProgram) -> Result<Vec<u8>> {
    let mut n = 0usize;
    // SAFETY: `prog` compiled successfully; `n` is valid for writes.
    nv_check("CUBIN size", unsafe { nv::nvrtcGetCUBINSize(prog, &mut n) })?;
    let mut buf = vec![0u8; n];
    // SAFETY: `buf` holds the `n` bytes NVRTC reported.
    nv_check("CUBIN", unsafe {
        nv::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
    })?;
    Ok(buf)
}

/// The CUBIN of `src` for `sm_<arch>`: from the disk cache when a file with the same source,
/// header, options, architecture and NVRTC version exists, else compiled and stored. The flag
/// says whether it came from the cache.
pub fn compile_cached(src: &Source, arch: u32) -> Result<(Vec<u8>, bool)> {
    let file = cache_file(src, arch)?;
    if let Some(f) = &file
        && let Ok(bytes) = std::fs::read(f)
        && !bytes.is_empty()
    {
        return Ok((bytes, true));
    }
    Ok((compile_fresh(src, arch)?, false))
}

/// Compiles `src` for `sm_<arch>` and stores the CUBIN in the cache, replacing what was there
/// (also a damaged entry the driver refused).
pub fn compile_fresh(src: &Source, arch: u32) -> Result<Vec<u8>> {
    let bin = compile(src, arch)?;
    store_cached(src, arch, &bin)?;
    Ok(bin)
}

/// Puts `bin`, the CUBIN `compile(src, arch)` made, in the cache where `compile_cached` looks
/// (written aside, then renamed, so a reader never sees half a file). A cache that cannot be
/// written only costs a recompile next time: only NVRTC's absence is an error.
pub fn store_cached(src: &Source, arch: u32, bin: &[u8]) -> Result<()> {
    if let Some(f) = cache_file(src, arch)? {
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!(
            "tmp{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        if std::fs::write(&tmp, bin).is_ok() && std::fs::rename(&tmp, &f).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(())
}

/// `job(i)` for every i < n on up to `threads` threads (at least one), handed out longest
/// first by `cost(i)` so that no long job is left for the end; the results in order of i. NVRTC
/// compiles programs concurrently and a compilation is one thread's work, so this is how several
/// sources (or architectures) compile at once.
pub fn parallel_map<T: Send>(
    n: usize,
    threads: usize,
    cost: impl Fn(usize) -> usize,
    job: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(cost(i)));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, T)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads.clamp(1, n.max(1)))
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(&i) =
                        order.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                    {
                        mine.push((i, job(i)));
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_by_key(|d| d.0);
    done.into_iter().map(|d| d.1).collect()
}

/// Threads for compiling: one per core.
pub fn compile_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The cache entry for `src` on `sm_<arch>`: named by a hash of the source, the header and the
/// options, the architecture and the NVRTC version.
fn cache_file(src: &Source, arch: u32) -> Result<Option<PathBuf>> {
    let (major, minor) = nvrtc_version()?;
    let opts = options(arch).join(" ");
    let key = fnv1a(&[src.code.as_bytes(), HEADER.1.as_bytes(), opts.as_bytes()]);
    Ok(crate::cache::root().map(|d| {
        d.join("cuda").join(format!(
            "{}-{key:016x}-sm{arch}-nvrtc{major}.{minor}.cubin",
            src.name.trim_end_matches(".cu")
        ))
    }))
}
