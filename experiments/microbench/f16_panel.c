// f16_panel.c: the CPU F16 prefill tile over a panel of 48 rows x 64 tokens held in L2 (one
// thread), in the f32 layout (weights widened, activations widened) and the f16 layout (both
// kept as f16, widened by vcvtph2ps as they are loaded).
//   gcc -O3 -mavx512f -mavx512vl -mfma -mf16c f16_panel.c -o panel && ./panel STEPS PADA PADW REPS
//   (STEPS = k / 32: 64 for k = 2048, 256 for k = 8192; e.g. ./panel 64 0 0 20)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R 6
#define P 4
int STEPS=64, ROWS=48, PAIRS=32, PADA=0, PADW=0;
float *Wf, *Af; unsigned short *Wh, *Ah;
volatile float sink;
// current: weights [row][chain][step] 8 f32; acts [pair][chain][step] 16 f32
static inline void tile32(const float* w, int rs, const float* a0, int as, float* out){
  for(int c=0;c<4;c++){
    __m512 acc[P][R];
    _Pragma("GCC unroll 8") for(int p=0;p<P;p++) _Pragma("GCC unroll 8") for(int r=0;r<R;r++) acc[p][r]=_mm512_setzero_ps();
    for(int s=0;s<STEPS;s++){ int i=c*STEPS+s;
      __m512 y[P]; _Pragma("GCC unroll 8") for(int p=0;p<P;p++) y[p]=_mm512_load_ps(a0+p*as+16*i);
      _Pragma("GCC unroll 8") for(int r=0;r<R;r++){ __m512 wz=_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd((const double*)(w+r*rs+8*i))));
        _Pragma("GCC unroll 8") for(int p=0;p<P;p++) acc[p][r]=_mm512_fmadd_ps(wz,y[p],acc[p][r]); } }
    _Pragma("GCC unroll 8") for(int p=0;p<P;p++) _Pragma("GCC unroll 8") for(int r=0;r<R;r++) out[p]+=_mm512_reduce_add_ps(acc[p][r]);
  }
}
static inline void tile16(const unsigned short* w, int rs, const unsigned short* a0, int as, float* out){
  for(int c=0;c<4;c++){
    __m512 acc[P][R];
    _Pragma("GCC unroll 8") for(int p=0;p<P;p++) _Pragma("GCC unroll 8") for(int r=0;r<R;r++) acc[p][r]=_mm512_setzero_ps();
    for(int s=0;s<STEPS;s++){ int i=c*STEPS+s;
      __m512 y[P]; _Pragma("GCC unroll 8") for(int p=0;p<P;p++) y[p]=_mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(a0+p*as+16*i)));
      _Pragma("GCC unroll 8") for(int r=0;r<R;r++){ __m512 wz=_mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)(w+r*rs+8*i))));
        _Pragma("GCC unroll 8") for(int p=0;p<P;p++) acc[p][r]=_mm512_fmadd_ps(wz,y[p],acc[p][r]); } }
    _Pragma("GCC unroll 8") for(int p=0;p<P;p++) _Pragma("GCC unroll 8") for(int r=0;r<R;r++) out[p]+=_mm512_reduce_add_ps(acc[p][r]);
  }
}
int main(int argc,char**argv){
  STEPS=atoi(argv[1]); PADA=atoi(argv[2]); PADW=atoi(argv[3]); int reps=atoi(argv[4]);
  int rs32=4*STEPS*8+PADW*8, as32=4*STEPS*16+PADA*16;
  int rs16=4*STEPS*8+PADW*8, as16=4*STEPS*16+PADA*16;
  Wf=aligned_alloc(64,(size_t)ROWS*rs32*4+64); Af=aligned_alloc(64,(size_t)PAIRS*as32*4+64);
  Wh=aligned_alloc(64,(size_t)ROWS*rs16*2+64); Ah=aligned_alloc(64,(size_t)PAIRS*as16*2+64);
  for(size_t i=0;i<(size_t)ROWS*rs32;i++)Wf[i]=1e-3f; for(size_t i=0;i<(size_t)PAIRS*as32;i++)Af[i]=1e-3f;
  for(size_t i=0;i<(size_t)ROWS*rs16;i++)Wh[i]=0x1000; for(size_t i=0;i<(size_t)PAIRS*as16;i++)Ah[i]=0x1000;
  float out[P]={0};
  double fl=(double)reps*ROWS*PAIRS*2*STEPS*32*2/1e9;
  for(int round=0;round<2;round++){
  double t0=now();
  for(int k=0;k<reps;k++) for(int g=0;g<PAIRS;g+=P) for(int rb=0;rb<ROWS;rb+=R) tile32(Wf+(size_t)rb*rs32,rs32,Af+(size_t)g*as32,as32,out);
  double t1=now();
  for(int k=0;k<reps;k++) for(int g=0;g<PAIRS;g+=P) for(int rb=0;rb<ROWS;rb+=R) tile16(Wh+(size_t)rb*rs16,rs16,Ah+(size_t)g*as16,as16,out);
  double t2=now();
  printf("steps %d padA %d padW %d: f32 layout %.1f GFLOP/s, f16 layout %.1f GFLOP/s\n",STEPS,PADA,PADW,fl/(t1-t0),fl/(t2-t1));
  }
  sink=out[0];
}
