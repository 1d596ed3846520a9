// selftest.cu: small CUDA kernels, not part of oato, that check the emulator itself: that its
// warp shuffles return what the GPU's do, and that it reports the misuses emu.h promises to
// catch (a missing __syncthreads, divergent or post-return barriers, deadlocks, shuffles after
// lanes returned). test_kernels.py's "emulator" group launches them; each bad_* kernel is
// expected to fail or to give a wrong answer.

#include <cuda_fp16.h>

// out[5 * tid + j] for 64 threads (two warps): lane-id shuffles of each kind.
extern "C" __global__ void emu_shuffles(int* out) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int v = 100 * tid;
    int* o = out + 5 * tid;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    o[1] = __shfl_down_sync(0xffffffffu, v, 3);
    o[2] = __shfl_up_sync(0xffffffffu, v, 2);
    o[3] = __shfl_sync(0xffffffffu, v, 31 - lane);
    o[4] = __shfl_xor_sync(0xffffffffu, v, 4, 8); // width 8: stays within groups of 8
}

// Each thread writes shared[tid] and reads its neighbour's; without the barrier (sync = 0) the
// neighbour may not have written yet.
extern "C" __global__ void emu_neighbour(int* out, int sync) {
    __shared__ int s[128];
    const int tid = threadIdx.x, n = blockDim.x;
    s[tid] = 1000 * (int)blockIdx.x + tid;
    if (sync) __syncthreads();
    out[blockIdx.x * n + tid] = s[(tid + 1) % n];
}

extern "C" __global__ void bad_divergent_barrier(int* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void bad_barrier_after_return(int* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void bad_shuffle_after_return(int* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

extern "C" __global__ void bad_deadlock(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x == 0) {
        __syncthreads();
    } else {
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    }
    out[threadIdx.x] = v;
}

// y = x * 0.5 and x + 0 for x = 1e-38: 0 and 0 under -ftz=true (a denormal result, a denormal
// input), 5e-39 and 1e-38 without.
extern "C" __global__ void emu_flush(const float* x, float* y) {
    y[0] = x[0] * 0.5f;
    y[1] = x[1] + 0.0f;
}

// Writes one element past y[n - 1]: the tests' guard bytes must notice.
extern "C" __global__ void bad_write_past_end(float* y, int n) {
    if ((int)threadIdx.x <= n) y[threadIdx.x] = 1.0f;
}
