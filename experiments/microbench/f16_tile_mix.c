// f16_tile_mix.c: the instruction mix of the CPU F16 prefill tile (src/kernels/cpu/f16wide.rs),
// one thread, all data in L1, 24 FMAs a step: f32 weights broadcast from 32 bytes (bcast), full
// 512-bit weight loads (full), f16 weights broadcast from 16 bytes and widened (cvtb), and a
// tinyBLAS-like 4 x 6 tile widening every load (tiny). PADW / PADA: floats added to each weight
// row / activation row, so rows are not 4 KiB multiples apart.
//   gcc -O3 -mavx512f -mavx512vl -mfma -mf16c -DPADW=64 -DPADA=64 f16_tile_mix.c -o mix && ./mix
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R 6
#define P 4
float W[R][64*8+PADW] __attribute__((aligned(64)));   // per row: steps*8 floats
float A[P][64*16+PADA] __attribute__((aligned(64)));
unsigned short WH[R][64*8] __attribute__((aligned(64)));
unsigned short AH[6][64*16] __attribute__((aligned(64)));
volatile float sink;
__attribute__((noinline)) void bcast(int steps, long reps){
  __m512 acc[P][R]; for(int p=0;p<P;p++)for(int r=0;r<R;r++)acc[p][r]=_mm512_setzero_ps();
  for(long k=0;k<reps;k++) for(int s=0;s<steps;s++){
    __m512 y[P]; _Pragma("GCC unroll 8") for(int p=0;p<P;p++) y[p]=_mm512_load_ps(&A[p][16*s]);
    _Pragma("GCC unroll 8") for(int r=0;r<R;r++){ __m512 w=_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd((double*)&W[r][8*s])));
      _Pragma("GCC unroll 8") for(int p=0;p<P;p++) acc[p][r]=_mm512_fmadd_ps(w,y[p],acc[p][r]); }
  }
  float t=0; for(int p=0;p<P;p++)for(int r=0;r<R;r++) t+=_mm512_reduce_add_ps(acc[p][r]); sink=t;
}
__attribute__((noinline)) void full(int steps, long reps){
  __m512 acc[P][R]; for(int p=0;p<P;p++)for(int r=0;r<R;r++)acc[p][r]=_mm512_setzero_ps();
  for(long k=0;k<reps;k++) for(int s=0;s<steps;s++){
    __m512 y[P]; _Pragma("GCC unroll 8") for(int p=0;p<P;p++) y[p]=_mm512_load_ps(&A[p][16*s]);
    _Pragma("GCC unroll 8") for(int r=0;r<R;r++){ __m512 w=_mm512_load_ps(&W[r][8*(s&~1)]);
      _Pragma("GCC unroll 8") for(int p=0;p<P;p++) acc[p][r]=_mm512_fmadd_ps(w,y[p],acc[p][r]); }
  }
  float t=0; for(int p=0;p<P;p++)for(int r=0;r<R;r++) t+=_mm512_reduce_add_ps(acc[p][r]); sink=t;
}
__attribute__((noinline)) void cvtb(int steps, long reps){ // raw f16 weights: bcast128 + cvt
  __m512 acc[P][R]; for(int p=0;p<P;p++)for(int r=0;r<R;r++)acc[p][r]=_mm512_setzero_ps();
  for(long k=0;k<reps;k++) for(int s=0;s<steps;s++){
    __m512 y[P]; _Pragma("GCC unroll 8") for(int p=0;p<P;p++) y[p]=_mm512_load_ps(&A[p][16*s]);
    _Pragma("GCC unroll 8") for(int r=0;r<R;r++){ __m512 w=_mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_load_si128((__m128i*)&WH[r][8*s])));
      _Pragma("GCC unroll 8") for(int p=0;p<P;p++) acc[p][r]=_mm512_fmadd_ps(w,y[p],acc[p][r]); }
  }
  float t=0; for(int p=0;p<P;p++)for(int r=0;r<R;r++) t+=_mm512_reduce_add_ps(acc[p][r]); sink=t;
}
// tinyBLAS-like 4x6: both f16, cvt each
__attribute__((noinline)) void tiny(int steps, long reps){
  __m512 acc[4][6]; for(int p=0;p<4;p++)for(int r=0;r<6;r++)acc[p][r]=_mm512_setzero_ps();
  for(long k=0;k<reps;k++) for(int s=0;s<steps;s++){
    __m512 a[4]; _Pragma("GCC unroll 8") for(int i=0;i<4;i++) a[i]=_mm512_cvtph_ps(_mm256_load_si256((__m256i*)&WH[i][8*(s&~1)]));
    _Pragma("GCC unroll 8") for(int j=0;j<6;j++){ __m512 b=_mm512_cvtph_ps(_mm256_load_si256((__m256i*)&AH[j][16*s]));
      _Pragma("GCC unroll 8") for(int i=0;i<4;i++) acc[i][j]=_mm512_fmadd_ps(a[i],b,acc[i][j]); }
  }
  float t=0; for(int p=0;p<4;p++)for(int r=0;r<6;r++) t+=_mm512_reduce_add_ps(acc[p][r]); sink=t;
}
int main(int c, char**v){
  long reps=2000000; int steps=32;
  for(int round=0;round<2;round++){
  double t0=now(); bcast(steps,reps); double t1=now(); full(steps,reps); double t2=now(); cvtb(steps,reps); double t3=now(); tiny(steps,reps); double t4=now();
  double f=reps*(double)steps*24*32/1e9;
  printf("bcast %.1f  full %.1f  cvtb %.1f  tiny %.1f GFLOP/s (1 thread)\n", f/(t1-t0), f/(t2-t1), f/(t3-t2), f/(t4-t3));
  }
}
