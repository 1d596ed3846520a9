// runtime.cpp: the launch side of the CUDA emulator (see emu.h for what is emulated and how):
// the kernel registry, the fiber scheduler for one thread block, the synchronisation points,
// and the C ABI the Python tests call through ctypes:
//   emu_kernel_count() / emu_kernel_name(i) / emu_kernel_source(i) / emu_kernel_signature(i)
//   emu_launch(name, grid[3], block[3], sig, params) -> 0, or -1 with emu_last_error()
// A launch that goes wrong (signature mismatch, deadlock, divergent barrier, ...) returns an
// error and leaves its fibers behind unfinished (kernels hold no resources); the next launch
// starts afresh.

#include "emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>

// On x86-64 (without AddressSanitizer) fibers switch with a few instructions instead of
// swapcontext, which makes a signal-mask system call on every switch: the callee-saved registers
// go on the old stack and the stack pointer is swapped. MXCSR and the x87 control word are not
// switched: a launch sets them once (DenormalsFlushed) and kernel code never changes them.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#endif

namespace emu {

uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;

// ---------------------------------------------------------------------------------------------
// Registry

namespace {
struct Kernel {
    std::string name, source, sig;
    Launcher launch;
};
std::vector<Kernel>& registry() {
    static std::vector<Kernel> r;
    return r;
}
std::string last_error;
} // namespace

void register_kernel(const char* name, const char* source, const std::string& sig, Launcher f) {
    registry().push_back({name, source, sig, f});
}

int fail(const std::string& msg) {
    if (last_error.empty()) last_error = msg;
    return -1;
}

// ---------------------------------------------------------------------------------------------
// Fibers

namespace {
constexpr size_t kStack = 256 * 1024; // per CUDA thread; the lowest page is a guard
constexpr int kMaxThreads = 1024;

enum class St { Ready, AtBarrier, AtWarp, Done };

struct Fiber {
#if EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    St st = St::Done;
    uint3 tid{};
    const char* file = nullptr; // the __syncthreads it waits at
    int line = 0;
    // Warp exchange: what this lane offers and asks for, and what it gets.
    unsigned mask = 0;
    int kind = 0, arg = 0, width = 0;
    unsigned long long in = 0, out = 0;
};

std::vector<void*> stacks; // one per CUDA thread, mapped when first needed, then reused
Fiber fibers[kMaxThreads];
int n_threads = 0;
Fiber* cur = nullptr;
#if EMU_FAST_SWITCH
void* sched_sp = nullptr;
#else
ucontext_t sched_ctx;
#endif
void (*body_fn)(void*) = nullptr;
void* body_ctx = nullptr;
std::string block_error; // set by a fiber or the scheduler; ends the block
#if defined(__SANITIZE_ADDRESS__)
const void* sched_stack_bottom = nullptr;
size_t sched_stack_size = 0;
#endif

const char* kind_name(int kind) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync", "__syncwarp"};
    return names[kind];
}

std::string where(const Fiber& f) {
    char b[96];
    snprintf(b, sizeof b, "thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
    return b;
}

// Fiber -> scheduler.
void yield_to_scheduler() {
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, sched_stack_bottom, sched_stack_size);
    swapcontext(&cur->ctx, &sched_ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#elif EMU_FAST_SWITCH
    emu_switch(&cur->sp, sched_sp);
#else
    swapcontext(&cur->ctx, &sched_ctx);
#endif
}

void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, &sched_stack_bottom, &sched_stack_size);
#endif
    body_fn(body_ctx);
    cur->st = St::Done;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(nullptr, sched_stack_bottom, sched_stack_size);
#endif
#if EMU_FAST_SWITCH
    void* unused;
    emu_switch(&unused, sched_sp); // a finished fiber never resumes
#else
    setcontext(&sched_ctx); // a finished fiber never resumes
#endif
}

// Scheduler -> fiber f.
void resume(Fiber& f) {
    cur = &f;
    thread_idx = f.tid;
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, (char*)f.ctx.uc_stack.ss_sp, f.ctx.uc_stack.ss_size);
    swapcontext(&sched_ctx, &f.ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#elif EMU_FAST_SWITCH
    emu_switch(&sched_sp, f.sp);
#else
    swapcontext(&sched_ctx, &f.ctx);
#endif
    cur = nullptr;
}

bool map_stacks(int n) {
    const long page = 4096;
    while ((int)stacks.size() < n) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, page, PROT_NONE); // overflow faults instead of corrupting the next stack
        stacks.push_back(p);
    }
    return true;
}

// Completes the warp exchanges and barriers that every participant has reached; returns whether
// any fiber became ready. Sets block_error on a misuse or a deadlock.
bool release() {
    bool any = false;
    const int n_warps = (n_threads + 31) / 32;
    for (int w = 0; w < n_warps; ++w) {
        Fiber* lanes = fibers + 32 * w;
        const int n = n_threads - 32 * w < 32 ? n_threads - 32 * w : 32;
        int waiting = 0, done = 0;
        for (int l = 0; l < n; ++l) {
            waiting += lanes[l].st == St::AtWarp;
            done += lanes[l].st == St::Done;
        }
        if (waiting == 0) continue;
        const Fiber& a = *std::find_if(lanes, lanes + n, [](const Fiber& f) {
            return f.st == St::AtWarp;
        });
        if (done > 0) {
            block_error = std::string(kind_name(a.kind)) + " in warp " + std::to_string(w) +
                          " after " + std::to_string(done) +
                          " of its lanes returned (undefined on the GPU)";
            return false;
        }
        if (waiting < n) continue; // the rest are at a barrier: a deadlock, reported below
        const unsigned full = n == 32 ? 0xffffffffu : (1u << n) - 1;
        for (int l = 0; l < n; ++l) {
            const Fiber& f = lanes[l];
            if (f.mask != full) {
                char b[128];
                snprintf(b, sizeof b, " with mask %#x in warp %d of %d lanes: only masks naming "
                         "exactly the warp's lanes are emulated", f.mask, w, n);
                block_error = kind_name(f.kind) + std::string(b);
                return false;
            }
            if (f.kind != a.kind || f.width != a.width) { // the offset may differ per lane
                block_error = "warp " + std::to_string(w) + " diverged: a lane in " +
                              kind_name(a.kind) + " (width " + std::to_string(a.width) +
                              "), lane " + std::to_string(l) + " in " + kind_name(f.kind) +
                              " (width " + std::to_string(f.width) + ")";
                return false;
            }
        }
        for (int l = 0; l < n; ++l) {
            Fiber& f = lanes[l];
            const int seg = l / f.width * f.width;
            int src = l;
            switch (f.kind) {
            case 0: src = seg + ((f.arg % f.width) + f.width) % f.width; break;
            case 1: src = l - seg >= f.arg ? l - f.arg : l; break;
            case 2: src = l - seg + f.arg < f.width ? l + f.arg : l; break;
            case 3: src = (l ^ f.arg) < seg + f.width ? l ^ f.arg : l; break;
            default: break; // __syncwarp
            }
            f.out = src < n ? lanes[src].in : f.in;
            f.st = St::Ready;
        }
        any = true;
    }
    if (any) return true;

    // Barrier: every thread that has not returned is at a __syncthreads.
    int at_bar = 0, done = 0;
    const Fiber* first = nullptr;
    for (int i = 0; i < n_threads; ++i) {
        at_bar += fibers[i].st == St::AtBarrier;
        done += fibers[i].st == St::Done;
        if (!first && fibers[i].st == St::AtBarrier) first = &fibers[i];
    }
    if (at_bar == 0 || at_bar + done < n_threads) {
        // Someone waits in a warp exchange whose other lanes wait at a barrier.
        std::string s = "deadlock:";
        for (int i = 0; i < n_threads; ++i) {
            if (fibers[i].st == St::AtWarp) {
                s += " " + where(fibers[i]) + " in " + kind_name(fibers[i].kind) + ",";
                break;
            }
        }
        if (first) s += " " + where(*first) + " at __syncthreads (" + first->file + ":" +
                        std::to_string(first->line) + ")";
        block_error = s;
        return false;
    }
    if (done > 0) {
        block_error = "__syncthreads (" + std::string(first->file) + ":" +
                      std::to_string(first->line) + ") reached after " + std::to_string(done) +
                      " thread(s) of the block returned";
        return false;
    }
    for (int i = 0; i < n_threads; ++i) {
        const Fiber& f = fibers[i];
        if (f.line != first->line || strcmp(f.file, first->file) != 0) {
            block_error = "divergent __syncthreads: " + where(*first) + " at " + first->file +
                          ":" + std::to_string(first->line) + ", " + where(f) + " at " + f.file +
                          ":" + std::to_string(f.line);
            return false;
        }
    }
    for (int i = 0; i < n_threads; ++i) fibers[i].st = St::Ready;
    return true;
}

// Thread i of the block, ready to start the kernel on its own stack.
void init_fiber(int i) {
    Fiber& f = fibers[i];
    f = Fiber{};
    f.tid = uint3{(unsigned)(i % block_dim.x), (unsigned)(i / block_dim.x % block_dim.y),
                  (unsigned)(i / (block_dim.x * block_dim.y))};
    f.st = St::Ready;
#if EMU_FAST_SWITCH
    // The frame emu_switch pops: six registers, then it returns into fiber_main with the stack
    // aligned as after a call (a zero return address above).
    auto* top = (uint64_t*)((char*)stacks[i] + kStack);
    top[-1] = 0;
    top[-2] = (uint64_t)(uintptr_t)&fiber_main;
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    f.sp = &top[-8];
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i];
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

// Runs one thread block to the end; false with block_error set when it went wrong.
bool run_block(bool reverse) {
    for (int i = 0; i < n_threads; ++i) init_fiber(i);
    for (;;) {
        for (int k = 0; k < n_threads; ++k) {
            Fiber& f = fibers[reverse ? n_threads - 1 - k : k];
            if (f.st != St::Ready) continue;
            resume(f);
            if (!block_error.empty()) return false;
        }
        bool all_done = true;
        for (int i = 0; i < n_threads; ++i) all_done &= fibers[i].st == St::Done;
        if (all_done) return true;
        if (!release()) return false;
    }
}

// Flush f32 denormals (results and inputs) during a launch, as -ftz=true does.
struct DenormalsFlushed {
#if defined(__x86_64__)
    unsigned saved = _mm_getcsr();
    DenormalsFlushed() { _mm_setcsr(saved | 0x8040); }
    ~DenormalsFlushed() { _mm_setcsr(saved); }
#endif
};

const char* order_env() {
    const char* o = getenv("OATO_CUDA_EMU_ORDER");
    return o ? o : "alternate";
}
} // namespace

// ---------------------------------------------------------------------------------------------
// Synchronisation points (called from kernel code, inside a fiber)

void sync_block(const char* file, int line) {
    cur->st = St::AtBarrier;
    cur->file = file;
    cur->line = line;
    yield_to_scheduler();
}

unsigned long long warp_exchange(unsigned mask, unsigned long long bits, int kind, int arg,
                                 int width) {
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
        block_error = std::string(kind_name(kind)) + " with width " + std::to_string(width) +
                      " (a power of two up to 32)";
        yield_to_scheduler(); // never resumed
    }
    cur->st = St::AtWarp;
    cur->mask = mask;
    cur->kind = kind;
    cur->arg = arg;
    cur->width = width;
    cur->in = bits;
    yield_to_scheduler();
    return cur->out;
}

void sync_warp(unsigned mask) {
    warp_exchange(mask, 0, 4, 0, 32);
}

// ---------------------------------------------------------------------------------------------
// Launch

int run_grid(const char* name, const unsigned* grid, const unsigned* block, void (*body)(void*),
             void* ctx) {
    const unsigned long long nt = (unsigned long long)block[0] * block[1] * block[2];
    if (nt == 0 || nt > kMaxThreads || block[2] > 64 || grid[0] == 0 || grid[1] == 0 ||
        grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535) {
        char b[160];
        snprintf(b, sizeof b, "%s: invalid launch grid (%u,%u,%u) block (%u,%u,%u)", name,
                 grid[0], grid[1], grid[2], block[0], block[1], block[2]);
        return fail(b);
    }
    if (!map_stacks((int)nt)) return fail("cannot map fiber stacks");
    n_threads = (int)nt;
    grid_dim = dim3(grid[0], grid[1], grid[2]);
    block_dim = dim3(block[0], block[1], block[2]);
    body_fn = body;
    body_ctx = ctx;
    const std::string order = order_env();
    DenormalsFlushed ftz;
    unsigned long long linear = 0;
    for (unsigned z = 0; z < grid[2]; ++z) {
        for (unsigned y = 0; y < grid[1]; ++y) {
            for (unsigned x = 0; x < grid[0]; ++x, ++linear) {
                block_idx = uint3{x, y, z};
                const bool reverse = order == "reverse" || (order == "alternate" && (linear & 1));
                block_error.clear();
                if (!run_block(reverse)) {
                    char b[128];
                    snprintf(b, sizeof b, "%s, block (%u,%u,%u) of (%u,%u,%u): ", name, x, y, z,
                             grid[0], grid[1], grid[2]);
                    return fail(b + block_error);
                }
            }
        }
    }
    return 0;
}

} // namespace emu

// ---------------------------------------------------------------------------------------------
// C ABI for the tests

extern "C" {
int emu_kernel_count() { return (int)emu::registry().size(); }
const char* emu_kernel_name(int i) { return emu::registry().at(i).name.c_str(); }
const char* emu_kernel_source(int i) { return emu::registry().at(i).source.c_str(); }
const char* emu_kernel_signature(int i) { return emu::registry().at(i).sig.c_str(); }
const char* emu_last_error() { return emu::last_error.c_str(); }

int emu_launch(const char* name, const unsigned* grid, const unsigned* block, const char* sig,
               void** params) {
    emu::last_error.clear();
    for (const auto& k : emu::registry()) {
        if (k.name == name) return k.launch(grid, block, sig, params);
    }
    return emu::fail(std::string("no kernel named ") + name);
}
}
