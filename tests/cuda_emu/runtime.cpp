// runtime.cpp: the launch side of the CUDA emulator (see emu.h for what is emulated and how):
// the kernel registry, the fiber scheduler for one thread block (its state local to the OS
// thread running the block), the threads that run a launch's blocks, the synchronisation
// points, and the C ABI the Python tests call through ctypes:
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
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
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

thread_local uint3 thread_idx, block_idx;
thread_local dim3 block_dim, grid_dim;

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
// Fiber i's stack starts kColour * (i % kColours) bytes below its mapping's top. The mappings are
// kStack apart, so without it every fiber's frames would sit at the same offset in a page and in
// a 256 KiB span: the same sets of the L1 and L2 caches, which the 128 fibers of a block thrash
// at every switch. With it their tops fall in different sets (576 bytes: nine cache lines, prime
// to the 64 sets of an L1's 4 KiB way). The lowest start leaves a fiber 183 of its 256 KiB; an
// overflow still ends in the guard page.
constexpr size_t kColour = 576;
constexpr int kColours = 128;
constexpr int kMaxThreads = 1024;

enum class St { Ready, AtBarrier, AtWarp, Done };

struct Fiber {
#if EMU_FAST_SWITCH
    void* sp;
#else
    ucontext_t ctx;
#endif
    St st;
    uint3 tid;
    const char* file; // the __syncthreads it waits at
    int line;
    // Warp exchange: what this lane offers and asks for, and what it gets.
    unsigned mask;
    int kind, arg, width;
    unsigned long long in, out;
};

// The scheduler's state, one per OS thread that runs blocks: what every switch touches in a few
// trivially initialised thread_local words (no initialisation guard on each access), the rest
// in `Held`, reached through one of them.
struct Held {
    Fiber fibers[kMaxThreads];
    std::vector<void*> stacks; // one per CUDA thread, mapped when first needed, then reused
    std::string block_error;   // set by a fiber or the scheduler; ends the block
#if !EMU_FAST_SWITCH
    ucontext_t sched_ctx;
#endif
};
thread_local Held* held = nullptr;
Held& H() {
    if (!held) held = new Held{}; // kept until the thread ends (the helpers never do)
    return *held;
}
thread_local int n_threads = 0;
thread_local Fiber* fibers = nullptr; // H().fibers, set by run_block: no check of `held` per use
thread_local Fiber* cur = nullptr;
#if EMU_FAST_SWITCH
thread_local void* sched_sp = nullptr;
#endif
thread_local bool run_reverse = false; // the block's fiber order (run_block's)
thread_local void (*body_fn)(void*) = nullptr;
thread_local void* body_ctx = nullptr;
#if defined(__SANITIZE_ADDRESS__)
thread_local const void* sched_stack_bottom = nullptr;
thread_local size_t sched_stack_size = 0;
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

#if EMU_FAST_SWITCH
// The lanes of f's warp: the first and how many.
Fiber* warp_of(const Fiber& f, int& n) {
    const int w0 = (int)(&f - fibers) / 32 * 32;
    n = n_threads - w0 < 32 ? n_threads - w0 : 32;
    return fibers + w0;
}

// The next lane of f's warp after f in the block's order (cyclically) that is ready to run,
// or null. A warp's lanes run one after another from one synchronisation point to the next in
// the block's order, as under the scheduler's rounds, but hand the OS thread to each other
// directly (one switch a lane, not two, and no round over the whole block); the scheduler takes
// over at a barrier, at the warp's end, and where the warp cannot go on (an error, reported by
// release()).
Fiber* next_ready_lane(const Fiber& f) {
    // The usual case first: the lane after f, in the block's order, has not run yet.
    const int i = (int)(&f - fibers);
    if (!run_reverse) {
        if ((i & 31) != 31 && i + 1 < n_threads && fibers[i + 1].st == St::Ready) {
            return fibers + i + 1;
        }
    } else if ((i & 31) != 0 && fibers[i - 1].st == St::Ready) {
        return fibers + i - 1;
    }
    int n;
    Fiber* lanes = warp_of(f, n);
    const int l = (int)(&f - lanes);
    if (!run_reverse) {
        for (int j = l + 1; j < n; ++j) {
            if (lanes[j].st == St::Ready) return lanes + j;
        }
        for (int j = 0; j < l; ++j) {
            if (lanes[j].st == St::Ready) return lanes + j;
        }
    } else {
        for (int j = l - 1; j >= 0; --j) {
            if (lanes[j].st == St::Ready) return lanes + j;
        }
        for (int j = n - 1; j > l; --j) {
            if (lanes[j].st == St::Ready) return lanes + j;
        }
    }
    return nullptr;
}

// Fiber -> fiber g of the same block, which resumes where it stopped (or starts).
void switch_to(Fiber& g) {
    Fiber* me = cur;
    cur = &g;
    thread_idx = g.tid;
    emu_switch(&me->sp, g.sp); // back here when a fiber or the scheduler resumes `me`
}
#endif // EMU_FAST_SWITCH: the hand-over needs the fast switch (not ASan's swapcontext path)

// Fiber -> scheduler.
void yield_to_scheduler() {
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, sched_stack_bottom, sched_stack_size);
    swapcontext(&cur->ctx, &H().sched_ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#elif EMU_FAST_SWITCH
    emu_switch(&cur->sp, sched_sp);
#else
    swapcontext(&cur->ctx, &H().sched_ctx);
#endif
}

void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, &sched_stack_bottom, &sched_stack_size);
#endif
    body_fn(body_ctx);
    cur->st = St::Done;
#if EMU_FAST_SWITCH
    if (Fiber* g = next_ready_lane(*cur)) switch_to(*g); // a finished fiber never resumes
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(nullptr, sched_stack_bottom, sched_stack_size);
#endif
#if EMU_FAST_SWITCH
    void* unused;
    emu_switch(&unused, sched_sp); // a finished fiber never resumes
#else
    setcontext(&H().sched_ctx); // a finished fiber never resumes
#endif
}

// Scheduler -> fiber f.
void resume(Fiber& f) {
    cur = &f;
    thread_idx = f.tid;
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, (char*)f.ctx.uc_stack.ss_sp, f.ctx.uc_stack.ss_size);
    swapcontext(&H().sched_ctx, &f.ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#elif EMU_FAST_SWITCH
    emu_switch(&sched_sp, f.sp);
#else
    swapcontext(&H().sched_ctx, &f.ctx);
#endif
    cur = nullptr;
}

bool map_stacks(int n) {
    Held& h = H();
    const long page = 4096;
    while ((int)h.stacks.size() < n) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, page, PROT_NONE); // overflow faults instead of corrupting the next stack
        h.stacks.push_back(p);
    }
    return true;
}

// The exchange every one of the n lanes of the warp starting at `lanes` waits in: each lane's
// result, and every lane ready; false with the block error set on a misuse.
bool complete_warp(Fiber* lanes, int n) {
    Held& h = H();
    const int w = (int)(lanes - fibers) / 32;
    const Fiber& a = lanes[0];
    const unsigned full = n == 32 ? 0xffffffffu : (1u << n) - 1;
    for (int l = 0; l < n; ++l) {
        const Fiber& f = lanes[l];
        if (f.mask != full) {
            char b[128];
            snprintf(b, sizeof b, " with mask %#x in warp %d of %d lanes: only masks naming "
                     "exactly the warp's lanes are emulated", f.mask, w, n);
            h.block_error = kind_name(f.kind) + std::string(b);
            return false;
        }
        if (f.kind != a.kind || f.width != a.width) { // the offset may differ per lane
            h.block_error = "warp " + std::to_string(w) + " diverged: a lane in " +
                          kind_name(a.kind) + " (width " + std::to_string(a.width) +
                          "), lane " + std::to_string(l) + " in " + kind_name(f.kind) +
                          " (width " + std::to_string(f.width) + ")";
            return false;
        }
    }
    // Every lane's kind and width are a's (checked above); the width is a power of two
    // (warp_exchange checked), so segments and the index's modulo are masks.
    const int width = a.width, wm = width - 1;
    for (int l = 0; l < n; ++l) {
        Fiber& f = lanes[l];
        const int seg = l & ~wm;
        int src = l;
        switch (a.kind) {
        case 0: src = seg + (f.arg & wm); break; // the index modulo the width, as CUDA takes it
        case 1: src = l - seg >= f.arg ? l - f.arg : l; break;
        case 2: src = l - seg + f.arg < width ? l + f.arg : l; break;
        case 3: src = (l ^ f.arg) < seg + width ? l ^ f.arg : l; break;
        default: break; // __syncwarp
        }
        f.out = src < n ? lanes[src].in : f.in; // `in` is not written here: any order will do
        f.st = St::Ready;
    }
    return true;
}

// Completes the warp exchanges and barriers that every participant has reached; returns whether
// any fiber became ready. Sets the block error (Held::block_error) on a misuse or a deadlock.
bool release() {
    Held& h = H();
    bool any = false;
    const int n_warps = (n_threads + 31) / 32;
    for (int w = 0; w < n_warps; ++w) {
        Fiber* lanes = h.fibers + 32 * w;
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
            h.block_error = std::string(kind_name(a.kind)) + " in warp " + std::to_string(w) +
                          " after " + std::to_string(done) +
                          " of its lanes returned (undefined on the GPU)";
            return false;
        }
        if (waiting < n) continue; // the rest are at a barrier: a deadlock, reported below
        if (!complete_warp(lanes, n)) return false;
        any = true;
    }
    if (any) return true;

    // Barrier: every thread that has not returned is at a __syncthreads.
    int at_bar = 0, done = 0;
    const Fiber* first = nullptr;
    for (int i = 0; i < n_threads; ++i) {
        at_bar += h.fibers[i].st == St::AtBarrier;
        done += h.fibers[i].st == St::Done;
        if (!first && h.fibers[i].st == St::AtBarrier) first = &h.fibers[i];
    }
    if (at_bar == 0 || at_bar + done < n_threads) {
        // Someone waits in a warp exchange whose other lanes wait at a barrier.
        std::string s = "deadlock:";
        for (int i = 0; i < n_threads; ++i) {
            if (h.fibers[i].st == St::AtWarp) {
                s += " " + where(h.fibers[i]) + " in " + kind_name(h.fibers[i].kind) + ",";
                break;
            }
        }
        if (first) s += " " + where(*first) + " at __syncthreads (" + first->file + ":" +
                        std::to_string(first->line) + ")";
        h.block_error = s;
        return false;
    }
    if (done > 0) {
        h.block_error = "__syncthreads (" + std::string(first->file) + ":" +
                      std::to_string(first->line) + ") reached after " + std::to_string(done) +
                      " thread(s) of the block returned";
        return false;
    }
    for (int i = 0; i < n_threads; ++i) {
        const Fiber& f = h.fibers[i];
        if (f.line != first->line || (f.file != first->file && strcmp(f.file, first->file) != 0)) {
            h.block_error = "divergent __syncthreads: " + where(*first) + " at " + first->file +
                          ":" + std::to_string(first->line) + ", " + where(f) + " at " + f.file +
                          ":" + std::to_string(f.line);
            return false;
        }
    }
    for (int i = 0; i < n_threads; ++i) h.fibers[i].st = St::Ready;
    return true;
}

// Every fiber's threadIdx, for the launch's block shape (the same in each of its blocks: set once
// a launch, not once a block).
void set_thread_ids() {
    Held& h = H();
    for (int i = 0; i < n_threads; ++i) {
        h.fibers[i].tid = uint3{(unsigned)(i % block_dim.x),
                                (unsigned)(i / block_dim.x % block_dim.y),
                                (unsigned)(i / (block_dim.x * block_dim.y))};
    }
}

// Thread i of the block (its threadIdx set by set_thread_ids), ready to start the kernel on its
// own stack. The exchange and barrier fields are written before they are read.
void init_fiber(int i) {
    Held& h = H();
    Fiber& f = h.fibers[i];
    f.st = St::Ready;
#if EMU_FAST_SWITCH
    // The frame emu_switch pops: six registers, then it returns into fiber_main with the stack
    // aligned as after a call (a zero return address above).
    auto* top = (uint64_t*)((char*)h.stacks[i] + kStack - kColour * (i % kColours));
    top[-1] = 0;
    top[-2] = (uint64_t)(uintptr_t)&fiber_main;
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    f.sp = &top[-8];
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = h.stacks[i];
    f.ctx.uc_stack.ss_size = kStack - kColour * (i % kColours);
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

// Runs one thread block to the end; false with the block error set when it went wrong.
bool run_block(bool reverse) {
    Held& h = H();
    fibers = h.fibers;
    run_reverse = reverse;
    for (int i = 0; i < n_threads; ++i) init_fiber(i);
    for (;;) {
        for (int k = 0; k < n_threads; ++k) {
            Fiber& f = h.fibers[reverse ? n_threads - 1 - k : k];
            if (f.st != St::Ready) continue;
            resume(f);
            if (!h.block_error.empty()) return false;
        }
        bool all_done = true;
        for (int i = 0; i < n_threads; ++i) all_done &= h.fibers[i].st == St::Done;
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

// OS threads a launch's blocks run on: OATO_CUDA_EMU_THREADS, else one per core, 1 to 8.
int emu_threads() {
    static const int n = [] {
        const char* e = getenv("OATO_CUDA_EMU_THREADS");
        const int want = e && *e ? atoi(e) : (int)std::thread::hardware_concurrency();
        return std::clamp(want, 1, 8);
    }();
    return n;
}

// Helper threads for launches (the launching thread works too); started on the first launch
// of more than one block and kept. One launch at a time.
class Helpers {
  public:
    // Runs work() on `n` helpers (fewer if there are fewer) and on the caller; returns when all
    // are done.
    void run(int n, const std::function<void()>& work) {
        std::unique_lock<std::mutex> launch(launch_mu_);
        {
            std::lock_guard<std::mutex> g(mu_);
            while (started_ < n) {
                // Detached: they wait for work until the process exits.
                std::thread([this, i = started_] { loop(i); }).detach();
                ++started_;
            }
            work_ = &work;
            wanted_ = n;
            running_ = n;
            ++generation_;
        }
        cv_.notify_all();
        work();
        std::unique_lock<std::mutex> g(mu_);
        done_cv_.wait(g, [this] { return running_ == 0; });
        work_ = nullptr;
    }

  private:
    void loop(int i) {
        unsigned long long seen = 0;
        for (;;) {
            const std::function<void()>* w;
            {
                std::unique_lock<std::mutex> g(mu_);
                cv_.wait(g, [&] { return generation_ != seen; });
                seen = generation_;
                if (i >= wanted_) continue;
                w = work_;
            }
            (*w)();
            std::lock_guard<std::mutex> g(mu_);
            if (--running_ == 0) done_cv_.notify_all();
        }
    }

    std::mutex launch_mu_, mu_;
    std::condition_variable cv_, done_cv_;
    int started_ = 0;
    const std::function<void()>* work_ = nullptr;
    unsigned long long generation_ = 0;
    int wanted_ = 0, running_ = 0;
};

Helpers& helpers() {
    // Never destroyed: its threads wait for work until the process exits.
    static Helpers* h = new Helpers;
    return *h;
}
} // namespace

// ---------------------------------------------------------------------------------------------
// Synchronisation points (called from kernel code, inside a fiber)

void sync_block(const char* file, int line) {
    cur->st = St::AtBarrier;
    cur->file = file;
    cur->line = line;
#if EMU_FAST_SWITCH
    if (Fiber* g = next_ready_lane(*cur)) return switch_to(*g);
#endif
    yield_to_scheduler(); // the warp's last lane here: the scheduler's next warp
}

namespace {
// Out of line, so that warp_exchange's frame holds no strings.
[[gnu::cold, gnu::noinline]] void bad_width(int kind, int width) {
    H().block_error = std::string(kind_name(kind)) + " with width " + std::to_string(width) +
                      " (a power of two up to 32)";
    yield_to_scheduler(); // never resumed
}
} // namespace

unsigned long long warp_exchange(unsigned mask, unsigned long long bits, int kind, int arg,
                                 int width) {
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0) bad_width(kind, width);
    cur->st = St::AtWarp;
    cur->mask = mask;
    cur->kind = kind;
    cur->arg = arg;
    cur->width = width;
    cur->in = bits;
#if EMU_FAST_SWITCH
    if (Fiber* g = next_ready_lane(*cur)) {
        switch_to(*g);
        return cur->out;
    }
    // The warp's last lane to arrive: if every lane waits here, the exchange completes now and
    // the warp goes on from its first lane in the block's order.
    int n, waiting = 0;
    Fiber* lanes = warp_of(*cur, n);
    for (int l = 0; l < n; ++l) waiting += lanes[l].st == St::AtWarp;
    if (waiting == n) {
        if (!complete_warp(lanes, n)) yield_to_scheduler(); // never resumed
        Fiber& first = lanes[run_reverse ? n - 1 : 0];
        if (&first != cur) switch_to(first);
        return cur->out;
    }
#endif
    yield_to_scheduler(); // some lane is at a barrier or done: release() reports it
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
    const std::string order = order_env();
    const bool all_reverse = order == "reverse", alternate = order == "alternate";
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    // Blocks are taken in grid order (x fastest) from `next`. The first failing block in grid
    // order is `stop` (with its error in `err`): the others take no blocks after it, so the
    // error reported is the one a single thread running them all would report.
    std::atomic<unsigned long long> next{0}, stop{blocks};
    std::mutex err_mu;
    std::string err;
    // Records a failure at block `linear` (0 for one before any block) if it is the first yet.
    const auto failed = [&](unsigned long long linear, std::string msg) {
        std::lock_guard<std::mutex> g(err_mu);
        if (linear < stop) {
            stop = linear;
            err = std::move(msg);
        }
    };
    const std::function<void()> work = [&] {
        if (!map_stacks((int)nt)) return failed(0, "cannot map fiber stacks");
        n_threads = (int)nt;
        grid_dim = dim3(grid[0], grid[1], grid[2]);
        block_dim = dim3(block[0], block[1], block[2]);
        set_thread_ids();
        body_fn = body;
        body_ctx = ctx;
        DenormalsFlushed ftz;
        for (;;) {
            const unsigned long long linear = next.fetch_add(1);
            if (linear >= stop.load()) return;
            const unsigned x = (unsigned)(linear % grid[0]),
                           y = (unsigned)(linear / grid[0] % grid[1]),
                           z = (unsigned)(linear / grid[0] / grid[1]);
            block_idx = uint3{x, y, z};
            const bool reverse = all_reverse || (alternate && (linear & 1));
            H().block_error.clear();
            if (!run_block(reverse)) {
                char b[128];
                snprintf(b, sizeof b, "%s, block (%u,%u,%u) of (%u,%u,%u): ", name, x, y, z,
                         grid[0], grid[1], grid[2]);
                return failed(linear, b + H().block_error);
            }
        }
    };
    const int helpers_wanted = (int)std::min<unsigned long long>(blocks, emu_threads()) - 1;
    if (helpers_wanted > 0) {
        helpers().run(helpers_wanted, work);
    } else {
        work();
    }
    return stop < blocks ? fail(err) : 0;
}

} // namespace emu

// ---------------------------------------------------------------------------------------------
// C ABI for the tests

// The library's only exported symbols (the build hides the rest: calls between its files then go
// straight to their targets, not through the PLT).
#pragma GCC visibility push(default)
extern "C" {
int emu_kernel_count() { return (int)emu::registry().size(); }
const char* emu_kernel_name(int i) { return emu::registry().at(i).name.c_str(); }
const char* emu_kernel_source(int i) { return emu::registry().at(i).source.c_str(); }
const char* emu_kernel_signature(int i) { return emu::registry().at(i).sig.c_str(); }
const char* emu_last_error() { return emu::last_error.c_str(); }

int emu_launch(const char* name, const unsigned* grid, const unsigned* block, const char* sig,
               void** params) {
    emu::last_error.clear();
    // Every kernel registered itself when the library was loaded, before any launch: the index
    // by name is built once (a launch used to compare names with every kernel's in turn).
    static const std::unordered_map<std::string, size_t> by_name = [] {
        std::unordered_map<std::string, size_t> m;
        for (size_t i = 0; i < emu::registry().size(); ++i) m.emplace(emu::registry()[i].name, i);
        return m;
    }();
    if (const auto it = by_name.find(name); it != by_name.end()) {
        return emu::registry()[it->second].launch(grid, block, sig, params);
    }
    return emu::fail(std::string("no kernel named ") + name);
}
}
#pragma GCC visibility pop
