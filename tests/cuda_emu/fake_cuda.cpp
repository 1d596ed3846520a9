// fake_cuda.cpp: a stand-in for libcuda.so and libcublas.so that runs the engine's whole CUDA
// backend (src/runtime/cuda_backend.rs, through cudarc) on the CPU: kernels run in the emulator
// (runtime.cpp + the unchanged src/kernels/cuda/*.cu), cublasGemmEx is a plain loop. Built by
// scripts/fake-gpu.sh; the engine loads it through LD_LIBRARY_PATH like the real libraries.
//
// It is not a GPU and gives no timings worth reading. What it checks, and a real driver would
// not report as clearly:
// - Streams run lazily. Work queued on a stream runs only when the host waits for it
//   (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize, a pageable device-to-host copy)
//   or when another stream's work waits on it, so a missing wait shows up as stale data. The
//   legacy default stream is ordered with the other blocking streams; non-blocking streams are
//   ordered only by events. Copies from page-locked memory read it when they run, so a staging
//   buffer reused too early shows up too.
// - Every pointer a kernel receives, and every copy and GEMM operand range, must lie inside a
//   live device allocation; each allocation has guard bytes, checked after every operation.
//   New allocations are filled with 0xFF bytes (NaN as f32/f16), so a read before a write shows.
// - cublasGemmEx's arguments are checked as cuBLAS documents them (leading dimensions, types).
// - Launch limits: gridDim.y/z <= 65535, <= 1024 threads per block, no dynamic shared memory.
// - CUDA graphs of kernel nodes (built node by node, instantiated, nodes updated, launched) are
//   replayed for real: a graph launch queues the kernels its nodes hold now.
// Any such error is printed on stderr ("fake-cuda: ...") and is sticky: every later call fails.
//
// Environment: OATO_FAKE_CUDA_MEM  device memory in bytes (default 4 GiB)
//              OATO_FAKE_CUDA_LOG=1  one stderr line per API call

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

extern "C" {
int emu_kernel_count();
const char* emu_kernel_name(int i);
const char* emu_kernel_signature(int i);
const char* emu_last_error();
int emu_launch(const char* name, const unsigned* grid, const unsigned* block, const char* sig,
               void** params);
}

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
constexpr CUresult OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3,
                   INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_HANDLE = 400,
                   NOT_FOUND = 500, LAUNCH_FAILED = 719, ILLEGAL_ADDRESS = 700,
                   INVALID_CONFIG = 9;
constexpr size_t GUARD = 64;
constexpr unsigned char GUARD_BYTE = 0xA5;

std::recursive_mutex mu;
CUresult sticky = OK;
bool initialised = false;

bool log_on() {
    static const bool on = getenv("OATO_FAKE_CUDA_LOG") && *getenv("OATO_FAKE_CUDA_LOG") == '1';
    return on;
}

void logf(const char* fmt, ...) {
    if (!log_on()) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fake-cuda: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

CUresult fault(CUresult code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fake-cuda: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    if (sticky == OK) sticky = code;
    return code;
}

size_t total_mem() {
    static const size_t t = [] {
        const char* e = getenv("OATO_FAKE_CUDA_MEM");
        return e ? (size_t)strtoull(e, nullptr, 10) : (size_t)4 << 30;
    }();
    return t;
}

// ---------------------------------------------------------------------------------------------
// Memory

struct Alloc {
    unsigned char* raw; // GUARD | size bytes | GUARD
    size_t size;
};
std::map<CUdeviceptr, Alloc> device; // by start address
size_t used = 0;
std::map<uintptr_t, size_t> pinned; // page-locked host allocations

const Alloc* find_dev(CUdeviceptr p, CUdeviceptr* base) {
    auto it = device.upper_bound(p);
    if (it == device.begin()) return nullptr;
    --it;
    if (p > it->first + it->second.size) return nullptr; // one past the end is allowed
    *base = it->first;
    return &it->second;
}

// [p, p + n) inside one live allocation?
bool dev_range(CUdeviceptr p, size_t n) {
    CUdeviceptr base;
    const Alloc* a = find_dev(p, &base);
    return a && p + n <= base + a->size;
}

bool is_pinned(const void* p, size_t n) {
    auto it = pinned.upper_bound((uintptr_t)p);
    if (it == pinned.begin()) return false;
    --it;
    return (uintptr_t)p + n <= it->first + it->second;
}

bool guards_ok(CUdeviceptr at, const Alloc& a, const char* after) {
    for (size_t i = 0; i < GUARD; ++i) {
        if (a.raw[i] != GUARD_BYTE || a.raw[GUARD + a.size + i] != GUARD_BYTE) {
            fault(ILLEGAL_ADDRESS, "%s wrote outside the %zu-byte allocation at 0x%llx", after,
                  a.size, at);
            return false;
        }
    }
    return true;
}

void check_all_guards(const char* after) {
    for (auto& [at, a] : device) {
        if (!guards_ok(at, a, after)) return;
    }
}

CUresult dev_alloc(CUdeviceptr* out, size_t n) {
    if (n == 0) return fault(INVALID_VALUE, "cuMemAlloc of 0 bytes");
    if (used + n > total_mem()) return OUT_OF_MEMORY;
    auto* raw = (unsigned char*)aligned_alloc(256, (GUARD * 2 + n + 255) / 256 * 256);
    if (!raw) return OUT_OF_MEMORY;
    memset(raw, GUARD_BYTE, GUARD);
    memset(raw + GUARD, 0xFF, n);
    memset(raw + GUARD + n, GUARD_BYTE, GUARD);
    *out = (CUdeviceptr)(raw + GUARD);
    device[*out] = {raw, n};
    used += n;
    return OK;
}

CUresult dev_free(CUdeviceptr p) {
    auto it = device.find(p);
    if (it == device.end()) return fault(INVALID_VALUE, "free of 0x%llx, not an allocation", p);
    guards_ok(p, it->second, "something");
    used -= it->second.size;
    free(it->second.raw);
    device.erase(it);
    return OK;
}

// ---------------------------------------------------------------------------------------------
// Streams and events

struct Stream;
struct Op {
    std::string what;
    std::function<void()> run;
    std::vector<std::pair<Stream*, uint64_t>> deps; // run those streams up to these first
};
struct Stream {
    bool nonblocking = false;
    std::deque<Op> queue;
    uint64_t queued = 0, done = 0;
};
Stream legacy; // the NULL stream
std::set<Stream*> streams{&legacy};

Stream* stream_of(void* h) {
    // CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) are treated as the legacy stream.
    if (h == nullptr || h == (void*)1 || h == (void*)2) return &legacy;
    return (Stream*)h;
}

void drain(Stream* s, uint64_t upto) {
    while (s->done < upto && sticky == OK) {
        Op op = std::move(s->queue.front());
        s->queue.pop_front();
        for (auto& [t, seq] : op.deps) drain(t, seq);
        if (sticky != OK) return;
        op.run();
        s->done++;
        check_all_guards(op.what.c_str());
    }
}

void drain_all() {
    for (Stream* s : streams) drain(s, s->queued);
}

void enqueue(void* h, std::string what, std::function<void()> run,
             std::vector<std::pair<Stream*, uint64_t>> deps = {}) {
    Stream* s = stream_of(h);
    if (s == &legacy) {
        for (Stream* t : streams) {
            if (t != &legacy && !t->nonblocking) deps.push_back({t, t->queued});
        }
    } else if (!s->nonblocking) {
        deps.push_back({&legacy, legacy.queued});
    }
    s->queue.push_back({std::move(what), std::move(run), std::move(deps)});
    s->queued++;
}

struct Event {
    Stream* stream = nullptr; // of the last record; null if never recorded
    uint64_t seq = 0;
    uint64_t generation = 0;
    bool done = true;
    double ms = 0;
};

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------------------------
// Modules and kernels

struct Function {
    std::string name, sig;
};
struct Module {
    std::vector<Function*> funcs;
};

size_t param_size(char c) {
    switch (c) {
    case 'p': case 'l': case 'd': return 8;
    default: return 4;
    }
}

// ---------------------------------------------------------------------------------------------
// cuBLAS

struct Blas {
    void* stream = nullptr;
};

float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { // subnormal
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float load(const void* p, int type, size_t i) {
    switch (type) {
    case 0: return ((const float*)p)[i];
    case 2: return half_to_float(((const uint16_t*)p)[i]);
    default: { // 14: bf16
        const uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    }
}

size_t type_size(int type) { return type == 0 ? 4 : 2; }

} // namespace

// ---------------------------------------------------------------------------------------------
// The driver API

#define API(name) extern "C" __attribute__((visibility("default"))) CUresult name
#define LOCK std::lock_guard<std::recursive_mutex> lock_(mu)
#define STICKY                                                                                 \
    do {                                                                                       \
        if (sticky != OK) return sticky;                                                       \
    } while (0)

API(cuDriverGetVersion)(int* v) {
    *v = 13000;
    return OK;
}

API(cuInit)(unsigned flags) {
    LOCK;
    logf("cuInit");
    initialised = true;
    return OK;
}

API(cuDeviceGetCount)(int* n) {
    if (!initialised) return NOT_INITIALIZED;
    *n = 1;
    return OK;
}

API(cuDeviceGet)(int* dev, int ordinal) {
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal != 0) return INVALID_DEVICE;
    *dev = 0;
    return OK;
}

API(cuDeviceGetName)(char* name, int len, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "oato fake CUDA device (CPU emulator, not a GPU)");
    return OK;
}

API(cuDeviceTotalMem_v2)(size_t* bytes, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    *bytes = total_mem();
    return OK;
}

API(cuDeviceGetAttribute)(int* v, int attr, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    switch (attr) {
    case 1: *v = 1024; break;                   // max threads per block
    case 2: case 3: *v = 1024; break;           // max block dim x, y
    case 4: *v = 64; break;                     // max block dim z
    case 5: *v = 2147483647; break;             // max grid dim x
    case 6: case 7: *v = 65535; break;          // max grid dim y, z
    case 8: *v = 49152; break;                  // shared memory per block
    case 10: *v = 32; break;                    // warp size
    case 16: *v = 132; break;                   // multiprocessors
    case 38: *v = 50 << 20; break;              // L2 cache bytes (an H100's)
    case 75: *v = 9; break;                     // compute capability major
    case 76: *v = 0; break;                     // minor
    case 115: *v = 1; break;                    // memory pools supported
    default: *v = 0;
    }
    return OK;
}

API(cuDevicePrimaryCtxRetain)(void** ctx, int dev) {
    if (!initialised) return NOT_INITIALIZED;
    if (dev != 0) return INVALID_DEVICE;
    static int the_context;
    *ctx = &the_context;
    return OK;
}

API(cuDevicePrimaryCtxRelease_v2)(int dev) { return OK; }
API(cuDevicePrimaryCtxSetFlags_v2)(int dev, unsigned flags) { return OK; }

thread_local void* current_ctx = nullptr;
API(cuCtxSetCurrent)(void* ctx) {
    current_ctx = ctx;
    return OK;
}
API(cuCtxGetCurrent)(void** ctx) {
    *ctx = current_ctx;
    return OK;
}

API(cuCtxSynchronize)() {
    LOCK;
    STICKY;
    drain_all();
    return sticky;
}

API(cuMemGetInfo_v2)(size_t* free_bytes, size_t* total) {
    LOCK;
    *total = total_mem();
    *free_bytes = total_mem() - used;
    return OK;
}

API(cuMemAlloc_v2)(CUdeviceptr* p, size_t n) {
    LOCK;
    STICKY;
    logf("cuMemAlloc %zu", n);
    return dev_alloc(p, n);
}

API(cuMemAllocAsync)(CUdeviceptr* p, size_t n, void* stream) {
    LOCK;
    STICKY;
    logf("cuMemAllocAsync %zu", n);
    return dev_alloc(p, n);
}

API(cuMemFree_v2)(CUdeviceptr p) {
    LOCK;
    logf("cuMemFree 0x%llx", p);
    drain_all(); // cuMemFree synchronises
    return dev_free(p);
}

API(cuMemFreeAsync)(CUdeviceptr p, void* stream) {
    LOCK;
    logf("cuMemFreeAsync 0x%llx", p);
    if (!device.count(p)) return fault(INVALID_VALUE, "cuMemFreeAsync of 0x%llx, not an allocation", p);
    enqueue(stream, "cuMemFreeAsync", [p] { dev_free(p); });
    return OK;
}

API(cuMemHostAlloc)(void** p, size_t n, unsigned flags) {
    LOCK;
    logf("cuMemHostAlloc %zu", n);
    void* m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!m) return OUT_OF_MEMORY;
    memset(m, 0xFF, n);
    pinned[(uintptr_t)m] = n;
    *p = m;
    return OK;
}

API(cuMemFreeHost)(void* p) {
    LOCK;
    auto it = pinned.find((uintptr_t)p);
    if (it == pinned.end()) return fault(INVALID_VALUE, "cuMemFreeHost of %p, not page-locked", p);
    drain_all(); // a real free waits for the copies that read it
    pinned.erase(it);
    free(p);
    return OK;
}

// Registered host memory (the model's memory map) reads like pinned memory: copies from it run
// when the stream does, so a source freed or changed too early shows up as wrong data.
API(cuMemHostRegister_v2)(void* p, size_t n, unsigned flags) {
    LOCK;
    logf("cuMemHostRegister %zu bytes at %p flags %u", n, p, flags);
    if (!p || n == 0) return fault(INVALID_VALUE, "cuMemHostRegister of %zu bytes at %p", n, p);
    if (is_pinned(p, 1) || is_pinned((const char*)p + n - 1, 1)) return 712; // ALREADY_REGISTERED
    if (getenv("OATO_FAKE_CUDA_NO_REGISTER")) return 801; // CUDA_ERROR_NOT_SUPPORTED
    pinned[(uintptr_t)p] = n;
    return OK;
}

API(cuMemHostUnregister)(void* p) {
    LOCK;
    auto it = pinned.find((uintptr_t)p);
    if (it == pinned.end()) return 713; // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    drain_all(); // copies from it must have run
    pinned.erase(it);
    return OK;
}

API(cuMemcpyHtoDAsync_v2)(CUdeviceptr dst, const void* src, size_t n, void* stream) {
    LOCK;
    STICKY;
    logf("cuMemcpyHtoDAsync %zu bytes to 0x%llx (%s)", n, dst, is_pinned(src, n) ? "pinned" : "pageable");
    if (!dev_range(dst, n)) {
        return fault(INVALID_VALUE, "host-to-device copy of %zu bytes to 0x%llx is outside every allocation", n, dst);
    }
    if (is_pinned(src, n)) {
        enqueue(stream, "host-to-device copy", [=] { memcpy((void*)dst, src, n); });
    } else { // pageable: staged at the call, so the caller may reuse its buffer at once
        auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                                   (const unsigned char*)src + n);
        enqueue(stream, "host-to-device copy", [=] { memcpy((void*)dst, staged->data(), n); });
    }
    return OK;
}

API(cuMemcpyDtoHAsync_v2)(void* dst, CUdeviceptr src, size_t n, void* stream) {
    LOCK;
    STICKY;
    logf("cuMemcpyDtoHAsync %zu bytes from 0x%llx (%s)", n, src, is_pinned(dst, n) ? "pinned" : "pageable");
    if (!dev_range(src, n)) {
        return fault(INVALID_VALUE, "device-to-host copy of %zu bytes from 0x%llx is outside every allocation", n, src);
    }
    enqueue(stream, "device-to-host copy", [=] { memcpy(dst, (const void*)src, n); });
    if (!is_pinned(dst, n)) { // pageable: returns when the copy is done
        Stream* s = stream_of(stream);
        drain(s, s->queued);
    }
    return sticky;
}

API(cuMemcpyDtoDAsync_v2)(CUdeviceptr dst, CUdeviceptr src, size_t n, void* stream) {
    LOCK;
    STICKY;
    if (!dev_range(src, n) || !dev_range(dst, n)) {
        return fault(INVALID_VALUE, "device-to-device copy of %zu bytes 0x%llx -> 0x%llx is outside an allocation", n, src, dst);
    }
    enqueue(stream, "device-to-device copy", [=] { memmove((void*)dst, (const void*)src, n); });
    return OK;
}

API(cuMemsetD8Async)(CUdeviceptr dst, unsigned char v, size_t n, void* stream) {
    LOCK;
    STICKY;
    if (!dev_range(dst, n)) return fault(INVALID_VALUE, "memset of %zu bytes at 0x%llx is outside every allocation", n, dst);
    enqueue(stream, "memset", [=] { memset((void*)dst, v, n); });
    return OK;
}

API(cuStreamCreate)(void** out, unsigned flags) {
    LOCK;
    auto* s = new Stream;
    s->nonblocking = flags & 1;
    streams.insert(s);
    *out = s;
    logf("cuStreamCreate %p%s", (void*)s, s->nonblocking ? " non-blocking" : "");
    return OK;
}

API(cuStreamCreateWithPriority)(void** out, unsigned flags, int priority) {
    return cuStreamCreate(out, flags);
}

API(cuStreamDestroy_v2)(void* h) {
    LOCK;
    Stream* s = stream_of(h);
    if (s == &legacy) return INVALID_HANDLE;
    drain(s, s->queued); // work already queued still runs
    // Events recorded on it and waits on them stay valid, so the (finished) stream is kept.
    streams.erase(s);
    return OK;
}

API(cuStreamSynchronize)(void* h) {
    LOCK;
    STICKY;
    Stream* s = stream_of(h);
    drain(s, s->queued); // the legacy stream's ops already depend on the blocking streams
    return sticky;
}

API(cuStreamWaitEvent)(void* h, void* ev, unsigned flags) {
    LOCK;
    STICKY;
    auto* e = (Event*)ev;
    std::vector<std::pair<Stream*, uint64_t>> deps;
    if (e->stream) deps.push_back({e->stream, e->seq});
    enqueue(h, "cuStreamWaitEvent", [] {}, std::move(deps));
    return OK;
}

API(cuEventCreate)(void** out, unsigned flags) {
    LOCK;
    *out = new Event;
    return OK;
}

API(cuEventDestroy_v2)(void* ev) {
    LOCK;
    // A recorded event may still be queued: its op keeps a generation check, so retire the
    // event object only after its stream has passed it.
    auto* e = (Event*)ev;
    if (e->stream) drain(e->stream, e->seq);
    delete e;
    return OK;
}

API(cuEventRecord)(void* ev, void* h) {
    LOCK;
    STICKY;
    auto* e = (Event*)ev;
    Stream* s = stream_of(h);
    const uint64_t gen = ++e->generation;
    e->done = false;
    enqueue(h, "cuEventRecord", [e, gen] {
        if (e->generation == gen) {
            e->done = true;
            e->ms = now_ms();
        }
    });
    e->stream = s;
    e->seq = s->queued;
    return OK;
}

API(cuEventSynchronize)(void* ev) {
    LOCK;
    STICKY;
    auto* e = (Event*)ev;
    if (e->stream) drain(e->stream, e->seq);
    return sticky;
}

API(cuEventQuery)(void* ev) {
    LOCK;
    STICKY;
    auto* e = (Event*)ev;
    if (e->stream) drain(e->stream, e->seq); // the device finishes as soon as anyone looks
    return sticky;
}

API(cuEventElapsedTime_v2)(float* ms, void* start, void* end) {
    LOCK;
    STICKY;
    auto *a = (Event*)start, *b = (Event*)end;
    if (!a->stream || !b->stream || !a->done || !b->done) return 600; // CUDA_ERROR_NOT_READY
    *ms = (float)(b->ms - a->ms);
    return OK;
}

API(cuEventElapsedTime)(float* ms, void* start, void* end) {
    return cuEventElapsedTime_v2(ms, start, end);
}

API(cuModuleLoadData)(void** out, const void* image) {
    LOCK;
    STICKY;
    // A CUBIN is an ELF file; keep its bytes to look kernels up by their .text.<name> section.
    const auto* b = (const unsigned char*)image;
    if (memcmp(b, "\x7f" "ELF", 4) != 0) return INVALID_IMAGE;
    const auto* eh = (const unsigned char*)image;
    uint64_t shoff;
    uint16_t shentsize, shnum;
    memcpy(&shoff, eh + 0x28, 8);
    memcpy(&shentsize, eh + 0x3A, 2);
    memcpy(&shnum, eh + 0x3C, 2);
    const size_t size = shoff + (size_t)shentsize * shnum;
    auto* m = new Module;
    const std::string bytes((const char*)image, size);
    for (int i = 0; i < emu_kernel_count(); ++i) {
        const std::string pat = std::string(".text.") + emu_kernel_name(i) + '\0';
        if (bytes.find(pat) != std::string::npos) {
            m->funcs.push_back(new Function{emu_kernel_name(i), emu_kernel_signature(i)});
        }
    }
    logf("cuModuleLoadData: %zu bytes, %zu kernels", size, m->funcs.size());
    *out = m;
    return OK;
}

API(cuModuleUnload)(void* m) {
    LOCK;
    drain_all();
    for (Function* f : ((Module*)m)->funcs) delete f;
    delete (Module*)m;
    return OK;
}

API(cuModuleGetFunction)(void** out, void* m, const char* name) {
    LOCK;
    for (Function* f : ((Module*)m)->funcs) {
        if (f->name == name) {
            *out = f;
            return OK;
        }
    }
    return NOT_FOUND;
}

// One kernel launch with its argument values copied, as a launch, a graph node or an
// instantiated graph's node holds it.
struct Kernel {
    Function* f;
    unsigned grid[3], block[3];
    std::vector<std::vector<unsigned char>> vals;
};

// Checks a launch as the driver would and copies its argument values into `k`.
CUresult make_kernel(const char* api, void* func, const unsigned grid[3], const unsigned block[3],
                     unsigned shmem, void** params, void** extra, Kernel* k) {
    auto* f = (Function*)func;
    if (!f) return fault(INVALID_HANDLE, "%s without a function", api);
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535 ||
        threads == 0 || threads > 1024 || block[2] > 64) {
        return fault(INVALID_CONFIG, "%s: %s with grid (%u,%u,%u) block (%u,%u,%u)", api,
                     f->name.c_str(), grid[0], grid[1], grid[2], block[0], block[1], block[2]);
    }
    if (shmem != 0) return fault(INVALID_VALUE, "%s: %s with %u bytes of dynamic shared memory (the kernels use none)", api, f->name.c_str(), shmem);
    if (extra) return fault(INVALID_VALUE, "%s: %s with `extra` parameters", api, f->name.c_str());
    k->f = f;
    std::copy(grid, grid + 3, k->grid);
    std::copy(block, block + 3, k->block);
    k->vals.clear();
    for (size_t i = 0; i < f->sig.size(); ++i) { // the values now, as the driver copies them
        const auto* p = (const unsigned char*)params[i];
        k->vals.emplace_back(p, p + param_size(f->sig[i]));
    }
    return OK;
}

// Every pointer argument of `k` lies in a live device allocation (checked when it is queued).
CUresult check_pointers(const char* api, const Kernel& k) {
    for (size_t i = 0; i < k.vals.size(); ++i) {
        if (k.f->sig[i] != 'p') continue;
        CUdeviceptr v, base;
        memcpy(&v, k.vals[i].data(), 8);
        if (v != 0 && !find_dev(v, &base)) {
            return fault(ILLEGAL_ADDRESS, "%s: %s parameter %zu is 0x%llx, not in any device allocation%s",
                         api, k.f->name.c_str(), i, v, is_pinned((void*)v, 1) ? " (it is page-locked host memory)" : "");
        }
    }
    return OK;
}

void enqueue_kernel(void* stream, const Kernel& k) {
    enqueue(stream, k.f->name, [k] {
        std::vector<void*> ptrs;
        for (auto& v : k.vals) ptrs.push_back((void*)v.data());
        if (emu_launch(k.f->name.c_str(), k.grid, k.block, k.f->sig.c_str(), ptrs.data()) != 0) {
            fault(LAUNCH_FAILED, "%s", emu_last_error());
        }
    });
}

API(cuLaunchKernel)(void* func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                    unsigned bz, unsigned shmem, void* stream, void** params, void** extra) {
    LOCK;
    STICKY;
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    Kernel k;
    if (CUresult r = make_kernel("cuLaunchKernel", func, grid, block, shmem, params, extra, &k)) return r;
    if (CUresult r = check_pointers("cuLaunchKernel", k)) return r;
    logf("launch %s grid (%u,%u,%u) block (%u,%u,%u)", k.f->name.c_str(), gx, gy, gz, bx, by, bz);
    enqueue_kernel(stream, k);
    return OK;
}

// ---------------------------------------------------------------------------------------------
// Graphs of kernel nodes. A graph launch queues its nodes' kernels on the stream, in the order
// they were added (a topological order: a node's dependencies exist before it). Every node but
// the first must depend on an earlier one: the engine builds chains, and a node without one
// would run concurrently with the others on a real GPU. An instantiated graph keeps its own copy
// of the nodes (later cuGraphExecKernelNodeSetParams calls change only it); pointers are checked
// again at every launch, since a buffer may have been freed since.

struct KernelNodeParams { // CUDA_KERNEL_NODE_PARAMS_v2
    void* func;
    unsigned grid[3], block[3], shmem;
    void** params;
    void** extra;
    void* kern;
    void* ctx;
};
struct GraphNode {
    Kernel k;
};
struct Graph {
    std::vector<std::unique_ptr<GraphNode>> nodes;
};
struct GraphExec {
    std::map<const GraphNode*, size_t> index;
    std::vector<Kernel> kernels;
};
std::set<Graph*> graphs;
std::set<GraphExec*> graph_execs;

CUresult node_kernel(const char* api, const KernelNodeParams* p, Kernel* k) {
    if (!p) return fault(INVALID_VALUE, "%s without parameters", api);
    if (p->kern) return fault(INVALID_VALUE, "%s with a CUkernel (the engine passes functions)", api);
    return make_kernel(api, p->func, p->grid, p->block, p->shmem, p->params, p->extra, k);
}

API(cuGraphCreate)(void** out, unsigned flags) {
    LOCK;
    STICKY;
    if (flags != 0) return fault(INVALID_VALUE, "cuGraphCreate flags %u", flags);
    auto* g = new Graph;
    graphs.insert(g);
    *out = g;
    return OK;
}

API(cuGraphAddKernelNode_v2)(void** out, void* graph, void** deps, size_t n_deps,
                             const KernelNodeParams* p) {
    LOCK;
    STICKY;
    auto* g = (Graph*)graph;
    if (!graphs.count(g)) return fault(INVALID_HANDLE, "cuGraphAddKernelNode: %p is not a graph", graph);
    for (size_t i = 0; i < n_deps; ++i) {
        bool found = false;
        for (auto& n : g->nodes) found |= n.get() == deps[i];
        if (!found) return fault(INVALID_VALUE, "cuGraphAddKernelNode: dependency %p is not a node of the graph", deps[i]);
    }
    if (!g->nodes.empty() && n_deps == 0) {
        return fault(INVALID_VALUE, "cuGraphAddKernelNode: node %zu depends on no earlier node, so it would run concurrently with them", g->nodes.size());
    }
    auto n = std::make_unique<GraphNode>();
    if (CUresult r = node_kernel("cuGraphAddKernelNode", p, &n->k)) return r;
    *out = n.get();
    g->nodes.push_back(std::move(n));
    return OK;
}

API(cuGraphInstantiateWithFlags)(void** out, void* graph, unsigned long long flags) {
    LOCK;
    STICKY;
    auto* g = (Graph*)graph;
    if (!graphs.count(g)) return fault(INVALID_HANDLE, "cuGraphInstantiate: %p is not a graph", graph);
    auto* e = new GraphExec;
    for (auto& n : g->nodes) {
        e->index[n.get()] = e->kernels.size();
        e->kernels.push_back(n->k);
    }
    graph_execs.insert(e);
    logf("cuGraphInstantiate %zu kernels", e->kernels.size());
    *out = e;
    return OK;
}

API(cuGraphExecKernelNodeSetParams_v2)(void* exec, void* node, const KernelNodeParams* p) {
    LOCK;
    STICKY;
    auto* e = (GraphExec*)exec;
    if (!graph_execs.count(e)) return fault(INVALID_HANDLE, "cuGraphExecKernelNodeSetParams: %p is not an instantiated graph", exec);
    auto it = e->index.find((const GraphNode*)node);
    if (it == e->index.end()) return fault(INVALID_VALUE, "cuGraphExecKernelNodeSetParams: %p is not a node of the graph", node);
    Kernel k;
    if (CUresult r = node_kernel("cuGraphExecKernelNodeSetParams", p, &k)) return r;
    Kernel& old = e->kernels[it->second];
    if (k.f != old.f) return fault(INVALID_VALUE, "cuGraphExecKernelNodeSetParams: %s node set to %s", old.f->name.c_str(), k.f->name.c_str());
    logf("cuGraphExecKernelNodeSetParams %s (node %zu)", k.f->name.c_str(), it->second);
    old = std::move(k);
    return OK;
}

API(cuGraphLaunch)(void* exec, void* stream) {
    LOCK;
    STICKY;
    auto* e = (GraphExec*)exec;
    if (!graph_execs.count(e)) return fault(INVALID_HANDLE, "cuGraphLaunch: %p is not an instantiated graph", exec);
    for (const Kernel& k : e->kernels) {
        if (CUresult r = check_pointers("cuGraphLaunch", k)) return r;
    }
    logf("cuGraphLaunch %zu kernels", e->kernels.size());
    for (const Kernel& k : e->kernels) enqueue_kernel(stream, k);
    return OK;
}

API(cuGraphExecDestroy)(void* exec) {
    LOCK;
    auto* e = (GraphExec*)exec;
    if (!graph_execs.erase(e)) return fault(INVALID_HANDLE, "cuGraphExecDestroy: %p is not an instantiated graph", exec);
    delete e; // queued launches hold their own copies
    return OK;
}

API(cuGraphDestroy)(void* graph) {
    LOCK;
    auto* g = (Graph*)graph;
    if (!graphs.erase(g)) return fault(INVALID_HANDLE, "cuGraphDestroy: %p is not a graph", graph);
    delete g;
    return OK;
}

// NVRTC opens libcuda too and asks for the driver's private tables; there are none here.
API(cuGetExportTable)(const void** table, const void* id) {
    *table = nullptr;
    return NOT_FOUND;
}

API(cuGetErrorString)(CUresult e, const char** s) {
    switch (e) {
    case OUT_OF_MEMORY: *s = "out of memory (fake-cuda, OATO_FAKE_CUDA_MEM)"; break;
    case NOT_INITIALIZED: *s = "initialization error"; break;
    case INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case NOT_FOUND: *s = "named symbol not found"; break;
    default: *s = "fake-cuda error (see the fake-cuda: line above on stderr)";
    }
    return OK;
}

API(cuGetErrorName)(CUresult e, const char** s) {
    static char b[32];
    snprintf(b, sizeof b, "CUDA_ERROR_%d", e);
    *s = b;
    return OK;
}

// ---------------------------------------------------------------------------------------------
// cuBLAS

API(cublasCreate_v2)(void** h) {
    *h = new Blas;
    return 0;
}

API(cublasDestroy_v2)(void* h) {
    LOCK;
    drain_all();
    delete (Blas*)h;
    return 0;
}

API(cublasSetStream_v2)(void* h, void* stream) {
    ((Blas*)h)->stream = stream;
    return 0;
}

// C = alpha op(A) op(B) + beta C, column-major, as cuBLAS documents it.
API(cublasGemmEx)(void* h, int transa, int transb, int m, int n, int k, const void* alpha,
                  const void* A, int atype, int lda, const void* B, int btype, int ldb,
                  const void* beta, void* C, int ctype, int ldc, int compute, int algo) {
    LOCK;
    constexpr int BAD = 7; // CUBLAS_STATUS_INVALID_VALUE
    auto bad = [&](const char* why) {
        fault(INVALID_VALUE, "cublasGemmEx(m=%d n=%d k=%d lda=%d ldb=%d ldc=%d): %s", m, n, k,
              lda, ldb, ldc, why);
        return BAD;
    };
    if (sticky != OK) return 13; // CUBLAS_STATUS_EXECUTION_FAILED
    auto known = [](int t) { return t == 0 || t == 2 || t == 14; };
    if (!known(atype) || atype != btype) return bad("A and B types must be one of 32F/16F/16BF and equal");
    if (ctype != 0) return bad("the engine's C is 32F");
    if (compute != 68 && compute != 74) return bad("compute type must be 32F");
    if ((transa != 0 && transa != 1) || (transb != 0 && transb != 1)) return bad("transpose");
    if (m < 0 || n < 0 || k < 0) return bad("negative size");
    const int arows = transa == 0 ? m : k, acols = transa == 0 ? k : m;
    const int brows = transb == 0 ? k : n, bcols = transb == 0 ? n : k;
    if (lda < std::max(1, arows) || ldb < std::max(1, brows) || ldc < std::max(1, m)) {
        return bad("leading dimension smaller than the rows");
    }
    if (m == 0 || n == 0) return 0;
    const size_t as = type_size(atype);
    auto extent = [](int ld, int rows, int cols, size_t es) {
        return ((size_t)ld * (cols - 1) + rows) * es;
    };
    if (k > 0 && (!dev_range((CUdeviceptr)A, extent(lda, arows, acols, as)) ||
                  !dev_range((CUdeviceptr)B, extent(ldb, brows, bcols, as)))) {
        return bad("A or B reaches outside its device allocation");
    }
    if (!dev_range((CUdeviceptr)C, extent(ldc, m, n, 4))) return bad("C reaches outside its device allocation");
    const float al = *(const float*)alpha, be = *(const float*)beta;
    logf("cublasGemmEx m=%d n=%d k=%d lda=%d ldb=%d ldc=%d beta=%g", m, n, k, lda, ldb, ldc, be);
    Blas* bl = (Blas*)h;
    enqueue(bl->stream, "cublasGemmEx", [=] {
        float* c = (float*)C;
        std::vector<float> bt((size_t)n * k), arow(k); // op(B) by columns, op(A) by rows
        for (int j = 0; j < n; ++j) {
            for (int p = 0; p < k; ++p) {
                bt[(size_t)j * k + p] =
                    load(B, btype, transb == 0 ? (size_t)j * ldb + p : (size_t)p * ldb + j);
            }
        }
        for (int i = 0; i < m; ++i) {
            for (int p = 0; p < k; ++p) {
                arow[p] = load(A, atype, transa == 0 ? (size_t)p * lda + i : (size_t)i * lda + p);
            }
            for (int j = 0; j < n; ++j) {
                const float* bc = &bt[(size_t)j * k];
                float acc = 0;
                for (int p = 0; p < k; ++p) acc += arow[p] * bc[p];
                float& out = c[(size_t)j * ldc + i];
                out = be == 0 ? al * acc : al * acc + be * out; // beta 0: C is not read
            }
        }
    });
    return 0;
}
