// emu.h: the CUDA device features oato's kernels use, for compiling the unchanged .cu files as
// host C++ (g++ -include emu.h) and running them on the CPU; runtime.cpp runs the launches.
//
// How CUDA is emulated
// - Types and f16/bf16 conversions are NVIDIA's own: the real cuda_fp16.h / cuda_bf16.h (with
//   vector_types.h: uint4, float2, ...) compile as host C++ and give __half, __half2,
//   __nv_bfloat16 and their conversions in host (software, correctly rounded) form.
// - A launch runs its thread blocks on a few OS threads (OATO_CUDA_EMU_THREADS, default one per
//   core, at most 8; 1 runs them one after another on the caller's thread), each thread taking
//   the next block in order. Each CUDA thread of a block is a fiber (a coroutine with its own
//   stack) on the OS thread running the block; a fiber runs until it reaches a synchronisation
//   point (__syncthreads, a warp shuffle, __syncwarp) or returns, then the next lane of its warp
//   runs: a warp goes on, shuffle after shuffle, until its lanes reach a barrier or return, then
//   the next warp runs (lanes hand over to each other directly; runtime.cpp).
//   Blocks alternate the fibers' order (forward, then reverse; OATO_CUDA_EMU_ORDER= forward /
//   reverse fixes it), so code that reads another thread's shared-memory writes without a
//   barrier sees stale data in one order or the other and fails its check. A launch that goes
//   wrong reports its first failing block in grid order, whatever the threads.
// - __shared__ variables are function statics local to the OS thread (static thread_local): one
//   copy a block, since an OS thread runs one block at a time. threadIdx / blockIdx / blockDim /
//   gridDim are thread-local variables the scheduler sets.
// - __syncthreads waits for every thread of the block; threads that reach different
//   __syncthreads lines, a __syncthreads after some threads have returned, a shuffle whose warp
//   has returned lanes, or lanes of a warp in different shuffle kinds or widths, are reported as
//   errors, as is a deadlock. Only full-warp masks are supported.
// - Integer intrinsics (__dp4a, __vsub4, __byte_perm, ...) are exact. The _rn float intrinsics
//   are IEEE operations the compiler cannot fuse (an empty asm keeps each rounding); other float
//   code is compiled with -ffp-contract=fast (and -mfma where the CPU has FMA), as nvcc fuses
//   a * b + c by default. During a launch the CPU flushes f32 denormals to zero (MXCSR
//   FTZ/DAZ), as --use_fast_math's -ftz=true does on the GPU.
// - The build aborts on a misaligned access (-fsanitize=alignment): the GPU faults on any load
//   or store not aligned to its size, a CPU does not.
//
// What it cannot catch
// - Timing, occupancy, register or shared-memory limits, bank conflicts, coalescing.
// - Exact fast-math results: expf / sqrtf / division keep host (libm, IEEE) accuracy where the GPU
//   uses approximations (__expf ~2 ulp); the tests' tolerances allow for the GPU's.
// - Races between blocks beyond what running them on a few threads at once happens to expose,
//   and inside a warp between sync points beyond what the two thread orders expose; the GPU's
//   memory model (atomicAdd and __threadfence are the host's sequentially consistent ones).
// - Reads of uninitialised shared memory (statics start at zero and keep the last block's data).
// - Out-of-bounds reads of global memory, unless built with OATO_CUDA_EMU_SAN=1 (AddressSanitizer
//   with exact-size buffers); out-of-bounds writes are caught by the tests' guard bytes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Execution-space keywords. The CUDA headers define them to nothing for a host compiler, except
// __shared__, which must be one object per block: a function-local static.

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __launch_bounds__
#ifdef EMU_LIST_KERNELS
#define __global__ EMU_KERNEL_MARK // the build finds kernel names in the preprocessed source
#else
#define __global__
#endif
#define __device__
#define __host__
#define __shared__ static thread_local
#define __launch_bounds__(...)

// ---------------------------------------------------------------------------------------------
// Built-in variables and synchronisation (runtime.cpp)

namespace emu {
// Thread-local, as the scheduler's state and the __shared__ variables are. The build compiles
// every file with -ftls-model=initial-exec: each access is one load at a fixed offset from the
// thread pointer, not a __tls_get_addr call (which cost a fifth of the time of a stand-in run).
// The library's thread-local block (its __shared__ arrays, about 1.7 MB) is then part of every
// thread's static TLS, for which glibc keeps little room in libraries loaded after start-up;
// the scripts that load it raise that room (GLIBC_TUNABLES glibc.rtld.optional_static_tls,
// from the size emulate-cuda-kernels.sh reads off the library). Where a glibc cannot load it so,
// the build falls back to the general-dynamic model (about a fifth slower; also
// OATO_CUDA_EMU_TLS=global-dynamic).
extern thread_local uint3 thread_idx, block_idx;
extern thread_local dim3 block_dim, grid_dim;

void sync_block(const char* file, int line);
// Warp exchange: every lane offers `bits`, gets the bits of the lane `kind` / `arg` / `width`
// select (kind: 0 idx, 1 up, 2 down, 3 xor), or its own where that lane is outside its segment.
unsigned long long warp_exchange(unsigned mask, unsigned long long bits, int kind, int arg,
                                 int width);
void sync_warp(unsigned mask);

template <class T>
T shuffle(unsigned mask, T v, int kind, int arg, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of 1..8 bytes");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof(T));
    b = warp_exchange(mask, b, kind, arg, width);
    T out;
    memcpy(&out, &b, sizeof(T));
    return out;
}

// Keeps a value in a register as computed: the compiler may not fuse across it.
inline float keep(float x) {
#if defined(__x86_64__)
    __asm__("" : "+x"(x));
#else
    __asm__("" : "+w"(x));
#endif
    return x;
}
} // namespace emu

#define threadIdx (static_cast<const uint3&>(::emu::thread_idx))
#define blockIdx (static_cast<const uint3&>(::emu::block_idx))
#define blockDim (static_cast<const dim3&>(::emu::block_dim))
#define gridDim (static_cast<const dim3&>(::emu::grid_dim))
#define warpSize 32

#define __syncthreads() ::emu::sync_block(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::sync_warp(mask); }

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return ::emu::shuffle(mask, v, 0, src, width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return ::emu::shuffle(mask, v, 1, (int)d, width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return ::emu::shuffle(mask, v, 2, (int)d, width);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return ::emu::shuffle(mask, v, 3, lane_mask, width);
}

// ---------------------------------------------------------------------------------------------
// Intrinsics

// The emulator has no clock to wait on: a sleep returns at once.
inline void __nanosleep(unsigned) {}

// Four signed (int) or unsigned byte products, summed into c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xFFu) * ((b >> (8 * i)) & 0xFFu);
    return c;
}
// Byte-wise a - b modulo 256, no borrow between bytes.
inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFFu) << (8 * i);
    return r;
}
inline unsigned __vadd4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) + (b >> (8 * i))) & 0xFFu) << (8 * i);
    return r;
}

// Byte i of the result: byte (s >> 4i) & 7 of the eight bytes of (y << 32) | x. Bit 3 of each
// selector nibble and the upper 16 bits of s are ignored, as CUDA documents __byte_perm.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
    }
    return r;
}

// IEEE round-to-nearest operations, each rounded on its own.
inline float __fadd_rn(float a, float b) { return ::emu::keep(::emu::keep(a) + ::emu::keep(b)); }
inline float __fsub_rn(float a, float b) { return ::emu::keep(::emu::keep(a) - ::emu::keep(b)); }
inline float __fmul_rn(float a, float b) { return ::emu::keep(::emu::keep(a) * ::emu::keep(b)); }
inline float __fdiv_rn(float a, float b) { return ::emu::keep(::emu::keep(a) / ::emu::keep(b)); }
inline float __frcp_rn(float a) { return ::emu::keep(1.0f / ::emu::keep(a)); }
inline float __fsqrt_rn(float a) { return ::emu::keep(sqrtf(::emu::keep(a))); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// Fast-math approximations: host accuracy (better than the GPU's; see the top).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }

// f32 to int, toward zero, saturating, NaN to 0 (cvt.rzi.s32.f32).
inline int __float2int_rz(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x <= -2147483648.0f) return -2147483647 - 1;
    return (int)x;
}
inline int __float2int_rn(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x <= -2147483648.0f) return -2147483647 - 1;
    return (int)nearbyintf(x);
}

inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; memcpy(&v, &f, 4); return v; }

template <class T>
T __ldg(const T* p) { return *p; }
template <class T>
T __ldcg(const T* p) { return *p; }

// Device-wide fences and atomics: blocks run on several OS threads at once, so these are the
// host's (sequentially consistent); fibers of one block share an OS thread and switch only at
// the sync points above.
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

// CUDA's integer and float min / max overloads.
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }

// ---------------------------------------------------------------------------------------------
// Kernel export (the build appends EMU_EXPORT(name) for each kernel it finds in a source)

namespace emu {
using Launcher = int (*)(const unsigned* grid, const unsigned* block, const char* sig,
                         void** params);
void register_kernel(const char* name, const char* source, const std::string& sig, Launcher f);
int run_grid(const char* name, const unsigned* grid, const unsigned* block, void (*body)(void*),
             void* ctx);
int fail(const std::string& msg);

// One letter per parameter type, as the tests spell launches: p pointer, i int, u unsigned,
// l long long, f float, d double.
template <class T>
constexpr char sig_char() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, int>) return 'i';
    else if constexpr (std::is_same_v<T, unsigned>) return 'u';
    else if constexpr (std::is_same_v<T, long long>) return 'l';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_same_v<T, double>) return 'd';
    else static_assert(sizeof(T) == 0, "kernel parameter type the emulator does not pass");
}

template <class... A>
std::string signature(void (*)(A...)) {
    return std::string{sig_char<A>()...};
}

// Launch kernel k with params[i] pointing at the value of parameter i (as cuLaunchKernel takes
// them), after checking the caller's signature string.
template <class... A>
int launch_typed(const char* name, void (*k)(A...), const unsigned* grid, const unsigned* block,
                 const char* sig, void** params) {
    const std::string want = signature(k);
    if (want != sig) {
        return fail(std::string(name) + " takes (" + want + ") but was launched with (" + sig +
                    ")");
    }
    struct Ctx {
        void (*k)(A...);
        std::tuple<A...> args;
    };
    Ctx ctx{k, [&]<size_t... I>(std::index_sequence<I...>) {
                return std::tuple<A...>(*(const A*)params[I]...);
            }(std::index_sequence_for<A...>{})};
    return run_grid(
        name, grid, block, [](void* c) {
            Ctx* x = (Ctx*)c;
            std::apply(x->k, x->args);
        },
        &ctx);
}

struct Registered {
    template <class... A>
    Registered(const char* name, const char* source, void (*k)(A...), Launcher f) {
        register_kernel(name, source, signature(k), f);
    }
};
} // namespace emu

#define EMU_EXPORT(name)                                                                       \
    static const ::emu::Registered emu_registered_##name(                                      \
        #name, EMU_SOURCE_NAME, &name,                                                         \
        [](const unsigned* g, const unsigned* b, const char* s, void** p) {                    \
            return ::emu::launch_typed(#name, &name, g, b, s, p);                              \
        });
